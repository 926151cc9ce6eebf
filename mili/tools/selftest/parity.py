"""Tiny random checkpoints (Qwen3 dense and MoE, and a hybrid Qwen3.5: Gated DeltaNet + full attention) built in
a folder, and MILI's greedy tokens against HF transformers' on them: float32, so the two must agree token for
token, except where HF's own top two logits nearly tie (random weights meet such ties; the tests' rule: at most
one prompt may part, and only there)."""

from __future__ import annotations

from pathlib import Path

import torch

DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
MOE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
           norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
# the hybrid (Qwen3_5ForCausalLM): 3 Gated DeltaNet layers and 1 full attention, GQA in both kinds, partial RoPE
HYBRID = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False)
HYBRID_WEIGHT_SCALE = 4.0
WEIGHT_SCALE = 8.0  # HF's init gives near-flat logits (ties everywhere); scaled up, greedy parity means something


def build(path: Path, kind: str, seed: int = 0, **overrides) -> Path:
    """A random float32 checkpoint folder (with the demo's byte-level tokenizer): kind dense | moe | hybrid."""
    import transformers as tf

    from mili.model.demo import build_demo_tokenizer

    tokenizer = build_demo_tokenizer()
    config_cls, model_cls, shape = {"dense": ("Qwen3Config", "Qwen3ForCausalLM", DENSE),
                                    "moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE),
                                    "hybrid": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", HYBRID)}[kind]
    config_cls, model_cls = getattr(tf, config_cls), getattr(tf, model_cls)
    cfg = config_cls(vocab_size=-(-len(tokenizer) // 64) * 64, max_position_embeddings=1024, rope_theta=10000.0,
                     eos_token_id=None, bos_token_id=None, pad_token_id=None, **{**shape, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if kind == "hybrid":  # (tests/support/hybrid.py's recipe)
                    if p.dim() >= 2 and "embed" not in name and "conv1d" not in name:
                        p.mul_(HYBRID_WEIGHT_SCALE)
                    elif name.endswith("linear_attn.norm.weight"):  # the gated norm: a plain weight
                        p.uniform_(0.5, 1.5)
                    elif "norm" in name:  # zero-centred: the scale is 1 + w
                        p.uniform_(-0.5, 0.5)
                    elif name.endswith("dt_bias"):
                        p.uniform_(-1.0, 1.0)
                elif p.dim() >= 2 and "embed" not in name:
                    p.mul_(WEIGHT_SCALE)
                elif "norm" in name:
                    p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_torch_paths() -> None:
    """Make HF's hybrid models (Qwen3.5, Qwen3.5 MoE, Qwen3-Next) run their own PyTorch gated-delta and causal-conv
    functions, whatever is installed: transformers picks flash-linear-attention's Triton kernels at import when
    the ``fla`` package is there, and those need a GPU, while the reference here runs on the CPU. Idempotent."""
    import functools
    import importlib
    import inspect

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update")
    for model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        try:
            module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        except ImportError:
            continue
        for name in names:
            wrapped = getattr(module, name, None)
            if wrapped is None or getattr(wrapped, "_mili_torch_path", False):
                continue
            torch_fn = inspect.unwrap(wrapped)  # the module's own function, under transformers' kernel wrappers
            params = inspect.signature(torch_fn).parameters
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

            def call(*args, _fn=torch_fn, _params=params, _any=takes_any, **kwargs):
                return _fn(*args, **(kwargs if _any else {k: v for k, v in kwargs.items() if k in _params}))

            call = functools.wraps(torch_fn)(call)
            call._mili_torch_path = True
            setattr(module, name, call)


def prompts(vocab: int, n: int = 4, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 256), (int(k),), generator=g).tolist()
            for k in torch.randint(3, 24, (n,), generator=g)]


def greedy_parity(path: Path, device: str, max_tokens: int = 12, teacher_forced: bool = False,
                  **engine_kwargs) -> tuple[bool, str]:
    """(ok, what was found) for MILI on ``device`` against HF on the CPU, float32. ``teacher_forced``: HF scores
    MILI's tokens in one forward over prompt + output (its greedy token at each step is the argmax there, up to
    where the two part) rather than generating them one step at a time (slow for HF's hybrids on the CPU)."""
    from transformers import AutoModelForCausalLM

    from mili import LLM, SamplingParams

    hf_torch_paths()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", device=device, kv_cache_memory=16 * 2**20, **engine_kwargs)
    ids = prompts(reference.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    exact, parted_at_tie = 0, 0
    for p, out in zip(ids, outs):
        x, got = torch.tensor([p]), out.outputs[0].token_ids
        with torch.no_grad():
            if teacher_forced:
                scores = reference(torch.tensor([p + got])).logits[0, len(p) - 1:len(p) - 1 + len(got)]
                want = scores.argmax(-1).tolist()
            else:
                ref = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                         do_sample=False, output_scores=True, return_dict_in_generate=True,
                                         pad_token_id=0)
                scores, want = torch.cat(ref.scores), ref.sequences[0, x.shape[1]:].tolist()
        parted = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if parted is None and len(got) == len(want) == max_tokens:
            exact += 1
            continue
        top2 = scores[parted].topk(2).values if parted is not None else None
        if top2 is None or top2[0] - top2[1] >= 1e-3:
            return False, f"prompt {len(p)} tokens: diverged at step {parted} without a near-tie"
        parted_at_tie += 1
    ok = exact >= len(ids) - 1
    return ok, f"{exact}/{len(ids)} prompts identical x {max_tokens} tokens" + \
        (f", {parted_at_tie} parted at a near-tie" if parted_at_tie else "")


def hybrid_parity(folder: Path, device: str) -> tuple[bool | None, str]:
    """Build the hybrid in ``folder``, then greedy_parity (teacher-forced), its longer prompts prefilled in 16-token
    chunks (the recurrent state carried between them); (None, why) where this transformers has no Qwen3.5 or MILI
    does not run hybrids on ``device`` yet."""
    import transformers

    from mili.errors import InvalidRequest

    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        return None, f"transformers {transformers.__version__} has no Qwen3.5"
    path = build(folder, "hybrid")
    try:
        return greedy_parity(path, device, teacher_forced=True, max_num_batched_tokens=16)
    except InvalidRequest as e:
        if torch.device(device).type == "cpu":
            raise
        return None, f"not on {device} yet: {e}"


def graph_equals_eager(path: Path, device: str) -> tuple[bool, str]:
    """CUDA graphs replayed (the default) against --enforce-eager: the same greedy tokens, bf16."""
    from mili import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = [{"prompt_token_ids": p} for p in prompts(256, n=6)]
    runs = []
    for eager in (False, True):
        llm = LLM(str(path), dtype="bfloat16", device=device, kv_cache_memory=16 * 2**20, enforce_eager=eager,
                  max_num_seqs=8)
        graphs = llm.engine.core.runner.parts.graphs
        runs.append([o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)])
        if not eager and graphs is None:
            return False, "no CUDA graphs were captured"
    same = sum(a == b for a, b in zip(*runs))
    return same == len(ids), f"{same}/{len(ids)} prompts identical (batch sizes 1-8 captured)"


def mixed_graphs_equal_eager(path: Path, device: str) -> tuple[bool, str]:
    """CUDA graphs of mixed steps (a 48-token budget: prompts' chunks beside other sequences' decodes) replayed
    against --enforce-eager: the same greedy tokens, bf16; and how many mixed steps replayed."""
    from mili import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = [{"prompt_token_ids": p} for p in prompts(256, n=8)]
    runs, replays = [], [0]
    for eager in (False, True):
        llm = LLM(str(path), dtype="bfloat16", device=device, kv_cache_memory=16 * 2**20, enforce_eager=eager,
                  max_num_seqs=8, max_num_batched_tokens=48)
        graphs = llm.engine.core.runner.parts.graphs
        if not eager:
            if graphs is None or not graphs.mixed.graphs:
                return False, "no CUDA graphs of mixed steps were captured"
            run = graphs.mixed.run

            def counting(batch, run=run):
                out = run(batch)
                replays[0] += out is not None
                return out

            graphs.mixed.run = counting
        runs.append([o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)])
    same = sum(a == b for a, b in zip(*runs))
    return same == len(ids) and replays[0] > 0, f"{same}/{len(ids)} prompts identical, {replays[0]} mixed steps replayed"


def async_steps_sync_once(path: Path, device: str) -> tuple[bool, str]:
    """Decode steps scheduled ahead of the device (--async-scheduling on) wait on the device at most once a step: the
    read of the previous step's tokens. Counted by torch's sync debug mode over 8 steady steps of 6 greedy
    sequences (a blocking copy, .item() or .tolist() of a device tensor on the way in would add one a step)."""
    import warnings

    from mili import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = LLM(str(path), dtype="bfloat16", device=device, kv_cache_memory=16 * 2**20, max_num_seqs=8,
              async_scheduling="on")
    llm.generate([{"prompt_token_ids": p} for p in prompts(256, n=2)], params, use_tqdm=False)  # (warm-up)
    engine = llm.engine
    for i, p in enumerate(prompts(256, n=6, seed=2)):
        engine.add_request(p, params, request_id=f"sync-{i}")
    for _ in range(4):  # (prefill, and the first decodes)
        engine.step()
    steps = 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    while engine.has_unfinished_requests():
        engine.step()
    return syncs <= steps, f"{syncs} host syncs in {steps} steps"


def async_launch_never_waits(path: Path, device: str) -> tuple[bool, str]:
    """Preparing and launching a step never waits on the device (a copy from pageable memory does, unseen by the
    sync debug mode): with ~50 ms of device work queued behind step N, ``step()`` (launch N + 1, read N) returns
    well before that work ends. Greedy and seeded random rows together (the sampler's metadata for both)."""
    import time

    from mili import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", device=device, kv_cache_memory=16 * 2**20, max_num_seqs=8,
              async_scheduling="on")
    engine = llm.engine
    for i, p in enumerate(prompts(256, n=6, seed=3)):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=64, ignore_eos=True)
        engine.add_request(p, params, request_id=f"launch-{i}")
    for _ in range(6):  # (prefill, graphs warm)
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(10**8)
    torch.cuda.synchronize()
    queued = time.perf_counter() - start
    took = []
    for _ in range(4):  # (each from an idle device: else the read of step N waits behind the last round's sleep)
        torch.cuda.synchronize()
        torch.cuda._sleep(10**8)
        start = time.perf_counter()
        engine.step()
        took.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    return max(took) < queued / 2, f"a step took {max(took) * 1e3:.1f} ms at most with {queued * 1e3:.0f} ms queued"

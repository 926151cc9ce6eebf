"""The hybrids (Gated DeltaNet + gated attention) on the CUDA path's pieces, on the CPU under TRITON_INTERPRET=1:
the gated attention layers on the Triton attention backend, decode steps through the CUDA-graph runner (its
state-slot buffers; the capture replaced by an eager stand-in as in test_cuda_only_paths.py), the gated delta
kernels' dispatch, and flash-linear-attention's kernels (fla-core, optional: those tests skip without it)
against mili/kernels/gated_delta.py and through the engine.

Not reachable here: fla's kernels compiled on a GPU, and under a real CUDA-graph capture."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from mili import LLM, InvalidRequest, SamplingParams  # noqa: E402
from mili.kernels import gated_delta as ref  # noqa: E402
from mili.kernels import gated_delta_fla  # noqa: E402
from mili.runtime.plan import AttentionBackend, GatedDeltaImpl  # noqa: E402
from support.engine_state import assert_drained, model_runner, runner_parts  # noqa: E402
from support.graphs import EagerGraphs  # noqa: E402

PROMPTS = [[7], [5, 6, 7, 8, 9], list(range(20, 60))]  # a one-token prompt; 40 > the 24-token budget: chunked
KW = dict(dtype="float32", max_num_batched_tokens=24, page_size=16, kv_cache_memory=2**21)


@pytest.fixture(scope="module")
def qwen3_5(hybrid_checkpoint):
    return hybrid_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def torch_tokens(qwen3_5):
    """Greedy tokens on the torch attention backend and the torch gated delta rule (tested against HF in
    test_hybrid.py)."""
    return _greedy(LLM(str(qwen3_5), attention_backend="torch", **KW))


def _greedy(llm, max_tokens: int = 4):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_drained(llm)
    return [o.outputs[0].token_ids for o in outs]


def test_hybrid_on_the_triton_attention_backend(qwen3_5, torch_tokens):
    """The gated attention layers' K/V in the paged pool through the Triton kernels (store, decode, prefill over a
    cached prefix): the torch backend's greedy tokens."""
    llm = LLM(str(qwen3_5), attention_backend="triton", **KW)
    plan, stats = llm.engine.plan, llm.engine.stats()
    assert plan.attention is AttentionBackend.TRITON and plan.gated_delta is not GatedDeltaImpl.FLA  # CPU: torch's gated delta rule
    # (the CUDA graphs' padding rows: one row past the slots and snapshots)
    assert runner_parts(llm).states.scratch_row == stats.num_state_slots + stats.num_snapshots
    assert _greedy(llm) == torch_tokens


class SlotGraphs(EagerGraphs):
    """Records each replayed step's state slots and whether each row resumes its state (``seen``)."""

    seen: list = []

    def run(self, batch):
        out = super().run(batch)
        if out is not None:
            n = batch.num_seqs
            bs = next(s for s in self.sizes if s >= n)
            SlotGraphs.seen.append((self.state_slots[:bs].tolist(), self.state_keep[:bs].tolist(), n))
        return out


def _garbage(runner) -> None:
    """Garbage in every row (free slots, the scratch row): a sequence's first token must not read its slot, and
    no real row may read the scratch row."""
    with torch.no_grad():
        for conv, ssm in runner.parts.states.caches:
            conv.fill_(7.0)
            ssm.fill_(7.0)


def test_hybrid_decode_through_the_graph_runner(qwen3_5, torch_tokens):
    """3 sequences padded to the captured 4: each row's state slot and whether it resumes its state are the
    graph's inputs (the one-token prompt's first step is a decode that starts from zeros), the padding row reads
    and writes the scratch row; greedy tokens are the eager path's."""
    llm = LLM(str(qwen3_5), attention_backend="triton", enforce_eager=True, max_num_seqs=4, **KW)
    runner = model_runner(llm)
    scratch = runner.parts.states.scratch_row
    _garbage(runner)
    runner.parts.graphs = SlotGraphs(runner.parts)
    assert runner.parts.graphs.sizes == [1, 2, 4] and set(runner.parts.graphs.graphs) == {1, 2, 4}
    SlotGraphs.replays, SlotGraphs.seen = 0, []
    assert _greedy(llm) == torch_tokens
    assert SlotGraphs.replays >= 2
    slots_of_running = set(range(llm.engine.stats().num_state_slots))
    for slots, keep, n in SlotGraphs.seen:
        assert set(slots[:n]) <= slots_of_running and len(set(slots[:n])) == n
        assert all(s == scratch for s in slots[n:]) and not any(keep[n:])
    assert any(n == 3 and all(keep[:3]) for _, keep, n in SlotGraphs.seen)
    # a one-token prompt alone: its first step is a decode through a graph, from zeros, not from what its slot
    # held (the previous sequences' states)
    SlotGraphs.seen = []
    _garbage(runner)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == torch_tokens[0]
    assert SlotGraphs.seen[0][1:] == ([False], 1) and len(SlotGraphs.seen) == 4
    llm.engine.check_integrity()


def test_gated_delta_dispatch(qwen3_5, monkeypatch):
    """The plan's choice: the torch code on the CPU; on CUDA fla's kernels, refused by name without fla-core;
    the layers call whatever ``use`` set."""
    from mili.config import EngineConfig, ModelConfig
    from mili.model.checkpoint import load_hf_config
    from mili.runtime.plan import DeviceInfo, plan

    config = EngineConfig(str(qwen3_5), attention_backend="torch", **KW)
    model_config = ModelConfig.from_hf(load_hf_config(str(qwen3_5)))
    h100 = dict(name="H100", capability=(9, 0), smem_per_block=227 * 1024, num_sms=132)
    assert plan(config, model_config, DeviceInfo("cpu", onednn_bf16="")).gated_delta is GatedDeltaImpl.TORCH
    assert plan(config, model_config, DeviceInfo("cuda", fla=True, **h100)).gated_delta is GatedDeltaImpl.FLA
    with pytest.raises(InvalidRequest, match="pip install fla-core"):
        plan(config, model_config, DeviceInfo("cuda", fla=False, **h100))

    llm = LLM(str(qwen3_5), attention_backend="torch", **KW)
    model = llm.apply_model(lambda m: m)
    calls = []

    def kernels(qkv, g, beta, weight, rb, conv_states, ssm_states, shape):
        calls.append((qkv.shape, g.shape, [p[2] for p in rb.prefills]))
        return torch.zeros(qkv.shape[0], shape.num_v_heads, shape.head_v_dim)

    assert gated_delta_fla.use(model, kernels) == 3  # the 3 Gated DeltaNet layers of 4
    llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(calls) == 3 and calls[0][0] == (5, model.linear_shape.conv_dim) and calls[0][1] == (5, 4)
    assert gated_delta_fla.use(model, None) == 3


# -- flash-linear-attention's kernels (fla-core) under the interpreter ---------------------------------------
@pytest.fixture(scope="module")
def fla():
    pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("these run fla's kernels on CPU tensors, under TRITON_INTERPRET=1")
    from support import fla_interpreter

    fla_interpreter.enable()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _inputs(length: int, seed: int, hk=2, hv=4, dk=16, dv=16):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(length, hk, dk, generator=g), torch.randn(length, hk, dk, generator=g)
    v = torch.randn(length, hv, dv, generator=g)
    gate = -torch.rand(length, hv, generator=g) * 2
    beta = torch.rand(length, hv, generator=g)
    return q, k, v, gate, beta, torch.randn(hv, dk, dv, generator=g)


def test_fla_chunk_varlen_matches_the_torch_reference(fla):
    """Two sequences in one varlen call (70 tokens: a whole chunk and a partial one, from a state; 5 tokens from
    zeros), GQA 2 key heads for 4 value heads: outputs and final states within float32 tolerance."""
    chunk, _ = fla
    a, b = _inputs(70, 0), _inputs(5, 1)
    cat = [torch.cat([x, y])[None] for x, y in zip(a[:5], b[:5])]
    h0 = torch.stack([a[5], torch.zeros_like(b[5])])
    out, ht = chunk(*cat[:3], g=cat[3], beta=cat[4], scale=16 ** -0.5, initial_state=h0, output_final_state=True,
                    use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, 70, 75]))
    ro_a, rs_a = ref.chunk_gated_delta_rule(*a[:5], a[5])
    ro_b, rs_b = ref.chunk_gated_delta_rule(*b[:5], None)
    torch.testing.assert_close(out[0], torch.cat([ro_a, ro_b]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ht, torch.stack([rs_a, rs_b]), atol=1e-5, rtol=1e-5)


def test_fla_recurrent_step_matches_the_torch_reference(fla):
    _, recurrent = fla
    q, k, v, gate, beta, _ = _inputs(3, 2)  # 3 sequences, one token each
    state = torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    out, ht = recurrent(q[:, None], k[:, None], v[:, None], g=gate[:, None], beta=beta[:, None], scale=16 ** -0.5,
                        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ro, rs = ref.recurrent_gated_delta_step(q, k, v, gate, beta, state)
    torch.testing.assert_close(out[:, 0], ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ht, rs, atol=1e-5, rtol=1e-5)


def test_fla_layer_matches_the_torch_layer(fla, qwen3_5):
    """One Gated DeltaNet layer over a mixed step, on fla's kernels and on the torch code, from the same random
    states: two decodes (one a sequence's first token, whose slot holds garbage), a prefill chunk resuming its
    slot's state and a fresh one; a slow decay (A_log = -4), so the states carry. Outputs and every state row
    (the untouched ones too) agree within float32 tolerance."""
    from mili.config import ModelConfig
    from mili.model.checkpoint import load_hf_config
    from mili.model.qwen3_5 import GatedDeltaNet, RecurrentBatch

    cfg = ModelConfig.from_hf(load_hf_config(str(qwen3_5)))
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, torch.float32)
    with torch.no_grad():
        layer.A_log.fill_(-4.0)
    shape = layer.shape
    conv = torch.randn(5, *shape.conv_state_shape())
    ssm = torch.randn(5, *shape.ssm_state_shape())
    rb = RecurrentBatch(torch.tensor([2, 0]), torch.tensor([True, False]), [(2, 32, 1, False), (32, 39, 3, True)])
    h = torch.randn(39, cfg.hidden_size)
    before = ssm.clone()
    with torch.no_grad():
        want_conv, want_ssm = conv.clone(), ssm.clone()
        want = layer(h, rb, want_conv, want_ssm)
        layer.kernels = gated_delta_fla.FlaGatedDelta()
        got = layer(h, rb, conv, ssm)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ssm, want_ssm, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(conv, want_conv, atol=1e-5, rtol=1e-5)
    assert torch.equal(ssm[4], before[4]) and not torch.allclose(ssm[[0, 1, 2, 3]], before[[0, 1, 2, 3]])


def test_hybrid_engine_on_fla_and_triton_attention(fla, qwen3_5, torch_tokens, monkeypatch):
    """The whole engine with fla's kernels for the Gated DeltaNet layers (decodes batched through the recurrent
    kernel with a first-token decode among them, prefill chunks through one varlen chunk call, a chunk resuming
    its slot's state) and the Triton attention backend: the torch path's greedy tokens. (This random model's
    decay is fast: its tokens barely depend on a resumed chunk's SSM state, which the layer test above checks.)"""
    from fla.ops import gated_delta_rule as fla_ops

    llm = LLM(str(qwen3_5), attention_backend="triton", **KW)
    calls = []
    chunk, recurrent = fla_ops.chunk_gated_delta_rule, fla_ops.fused_recurrent_gated_delta_rule
    monkeypatch.setattr(fla_ops, "chunk_gated_delta_rule", lambda *a, **kw: calls.append(
        ("chunk", kw["cu_seqlens_cpu"].tolist())) or chunk(*a, **kw))
    monkeypatch.setattr(fla_ops, "fused_recurrent_gated_delta_rule", lambda *a, **kw: calls.append(
        ("recurrent", a[0].shape[0])) or recurrent(*a, **kw))
    kernels = gated_delta_fla.FlaGatedDelta()  # (fla's two entry points, counted)
    assert gated_delta_fla.use(llm.apply_model(lambda m: m), kernels) == 3
    assert _greedy(llm) == torch_tokens
    assert any(c[0] == "chunk" and len(c[1]) >= 3 for c in calls)  # two prompts' chunks in one call
    assert any(c[0] == "recurrent" and c[1] >= 2 for c in calls)


def test_fla_kernels_compile_for_sm90():
    """fla's gated delta kernels as the hybrids launch them (prefill: the varlen chunk path's six kernels; decode:
    the fused recurrent kernel), recorded from fla's own wrappers with fla's hardware probe answering for an
    H100, compiled for sm_90 (``mili/tools/triton_checks/fla_check.py``, in a process without TRITON_INTERPRET)."""
    import importlib.util

    from mili.tools.triton_checks import fla_check

    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed (pip install fla-core)")
    result = fla_check.run(["--targets", "sm_90", "--dtypes", "bf16"])
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for kernel in ("l2norm_fwd_kernel", "chunk_local_cumsum_scalar_kernel", "chunk_gated_delta_rule_fwd_kkt_solve",
                   "recompute_w_u_fwd_kernel", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_fwd_kernel_o",
                   "fused_recurrent_gated_delta_rule_fwd_kernel"):
        assert f"{kernel}" in result.stdout
    assert "| sm_90 " in result.stdout and " 0 failed" in result.stdout

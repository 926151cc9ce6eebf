"""The CUDA-only code paths, reached from the CPU where they can be (issue 32's audit).

Reached here or elsewhere on the CPU:
- CUDA-graph replay (``CudaGraphRunner.run``: padding a batch up to a captured size, slot -1 rows, logits of
  the real rows, ``ModelRunner.forward_logits``' graph branch) for dense, MoE (graphs are off for MoE on CUDA
  until verified: this is that check's CPU half) and FP8 KV pages: here, with the capture replaced by an eager
  stand-in, on the Triton backend under the interpreter; for the hybrids (each row's state slot and first-token
  flag as graph inputs, padding rows on the scratch row): tests/unit/test_hybrid_triton.py;
- flash-linear-attention's gated delta kernels (the hybrids on CUDA): under the interpreter against the torch
  reference and through the engine, and compiled for sm_90 (fla_check), in test_hybrid_triton.py when fla-core
  is installed;
- the device's properties -> ``DeviceSpec`` (SM version, shared memory per block, SM count): here, from a
  stand-in of ``torch.cuda.get_device_properties``; tiles, stages and split K by device, start-up refusal:
  tests/unit/test_triton_compile.py;
- every Triton kernel compiled for sm_80 / sm_89 / sm_90: tests/unit/test_triton_compile.py;
- FP8 ``_scaled_mm`` dispatch (which layer each device gets, W8A8 by SM version): test_triton_quant.py's
  test_which_layer_each_device_gets; ``Fp8Linear`` on the CPU's ``_scaled_mm``: test_quantized_checkpoints.py;
- ``mili selftest``'s CUDA kernel checks: their code, on the CPU under the interpreter, here (slow).

Not reachable without a GPU (each needs a CUDA device or NCCL): the capture itself (``_capture``:
``torch.cuda.CUDAGraph``, the memory pool), the KV budget from ``torch.cuda.mem_get_info`` and the profiled
activation peak (``CacheMemory._kv_budget``, ``_profile_activation_peak``), the FP8 KV and Triton refusals on
a real device (the plan's ``_kv_dtype`` below SM 8.9 and its ``check_device``: their logic is tested on device
descriptions, tests/unit/test_plan.py and test_triton_compile.py), ``selftest.parity.graph_equals_eager``, tensor
parallelism over NCCL.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from support.checkpoints import build_moe_checkpoint  # noqa: E402
from support.engine_state import model_runner  # noqa: E402
from support.graphs import EagerGraphs  # noqa: E402
from mili import LLM, SamplingParams  # noqa: E402
from mili.kernels.triton import launch  # noqa: E402


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("kind", ["moe", "dense_fp8_kv", pytest.param("dense", marks=pytest.mark.slow)])
def test_graph_replay_path_equals_eager(kind, tiny_checkpoint, tmp_path):
    """Greedy tokens through the graph path (3 sequences padded to 4) are the eager path's (bf16; float32
    under the slow marker: the interpreter's float32 path is slower)."""
    path = build_moe_checkpoint(tmp_path / "moe", num_hidden_layers=1) if kind == "moe" else tiny_checkpoint
    kw = dict(dtype="float32" if kind == "dense" else "bfloat16", attention_backend="triton",
              enforce_eager=True, max_num_seqs=4, kv_cache_memory=2**20)
    if kind.endswith("fp8_kv"):
        kw["kv_cache_dtype"] = "fp8"
    prompts = [[5, 6, 7], [9] * 11, [3, 4]]  # 3 sequences: padded up to the captured 4
    eager = _greedy(LLM(str(path), **kw), prompts)
    llm = LLM(str(path), **kw)
    runner = model_runner(llm)
    runner.parts.graphs = EagerGraphs(runner.parts)
    assert runner.parts.graphs.sizes == [1, 2, 4] and set(runner.parts.graphs.graphs) == {1, 2, 4}
    EagerGraphs.replays = 0
    assert _greedy(llm, prompts) == eager
    assert EagerGraphs.replays >= 2  # the decode steps went through the graphs
    llm.engine.check_integrity()


class CountingMixed:
    """Counts the mixed steps a ``MixedStepGraphs`` replays."""

    def __init__(self, mixed):
        self.mixed, self.replays = mixed, 0

    def run(self, batch):
        out = self.mixed.run(batch)
        self.replays += out is not None
        return out


def test_mixed_step_graphs_equal_eager(tiny_checkpoint):
    """Steps with prefill chunks and decodes (a 24-token budget, prompts of several lengths) replayed through the
    mixed-step graphs (padded to 16 or 32 tokens over 6 sequence rows; attention by the one kernel whose launch reads
    no length) give the eager steps' greedy tokens."""
    import dataclasses

    kw = dict(dtype="float32", attention_backend="triton", enforce_eager=True, max_num_seqs=6,
              max_num_batched_tokens=24, kv_cache_memory=2**20)
    prompts = [[5, 6, 7], [9] * 30, [3, 4], list(range(40, 61)), [8] * 7, [2]]
    eager = _greedy(LLM(str(tiny_checkpoint), **kw), prompts)
    llm = LLM(str(tiny_checkpoint), **kw)
    runner = model_runner(llm)
    # (the CPU's plan captures none)
    runner.parts.plan = dataclasses.replace(runner.parts.plan, mixed_graph_sizes=(16, 32))
    runner.parts.graphs = EagerGraphs(runner.parts)
    assert set(runner.parts.graphs.mixed.graphs) == {16, 32}
    runner.parts.graphs.mixed = counting = CountingMixed(runner.parts.graphs.mixed)
    assert _greedy(llm, prompts) == eager
    assert counting.replays >= 2
    llm.engine.check_integrity()


def test_device_spec_from_the_device_properties(monkeypatch):
    l4 = SimpleNamespace(name="NVIDIA L4", major=8, minor=9, multi_processor_count=58)
    h100 = SimpleNamespace(name="NVIDIA H100", major=9, minor=0, multi_processor_count=132,
                           shared_memory_per_block_optin=232448)
    # (device_spec keeps each device's spec: indices no real device has, so nothing is kept for one)
    for index, props, smem in ((61, l4, 99 * 1024), (62, h100, 232448)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, p=props: p)
        spec = launch.device_spec(f"cuda:{index}")
        assert (spec.capability, spec.smem_per_block, spec.num_sms) == ((props.major, props.minor), smem,
                                                                        props.multi_processor_count)
    assert launch.device_spec("cpu") == launch.INTERPRETER


@pytest.mark.slow
def test_selftest_cuda_kernel_checks_run_under_the_interpreter():
    from mili.tools.selftest import kernels

    rows = kernels.triton_checks(torch.device("cpu"), (torch.bfloat16,), fp8=True)
    assert rows and all(ok for _, ok, _ in rows), rows

"""Batch limits sized by the device (issue 58): max_num_seqs and max_num_batched_tokens default to auto, which the
execution plan turns into values by the device's memory (mili/runtime/plan.py's BATCH_LIMITS), with the CUDA graphs'
ladder capped at 512; a value the user gives always wins; the engine core, the scheduler, the API side and /health
all see the values the plan chose."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient

from support.engine_state import engine_core
from mili import LLM, InvalidRequest, SamplingParams
from mili import options
from mili.config import EngineConfig
from mili.runtime import plan as plan_module
from mili.runtime.plan import (BATCH_LIMITS, GIB, MAX_GRAPH_BATCH, StepKind, batch_limits,
                               graph_batch_sizes, plan)
from test_plan import H100, ZEN3, engine, qwen3

# cards as torch.cuda.get_device_properties reports their total memory (bytes)
L4 = dataclasses.replace(H100, name="NVIDIA L4", memory=23_580_639_232)  # 24 GB: 22.0 GiB
RTX_4090 = dataclasses.replace(H100, name="NVIDIA GeForce RTX 4090", memory=25_386_352_640)  # 24 GB: 23.6 GiB
V100_32 = dataclasses.replace(H100, name="Tesla V100-SXM2-32GB", memory=34_089_730_048)  # 31.7 GiB
A100_40 = dataclasses.replace(H100, name="NVIDIA A100-SXM4-40GB", memory=42_505_273_344)  # 39.6 GiB
L40S = dataclasses.replace(H100, name="NVIDIA L40S", memory=47_697_362_944)  # 48 GB: 44.4 GiB
H100_80 = dataclasses.replace(H100, name="NVIDIA H100 80GB HBM3", memory=85_029_158_912)  # 79.2 GiB
H200 = dataclasses.replace(H100, name="NVIDIA H200", memory=150_754_820_096)  # 141 GB: 140.4 GiB
UNKNOWN = dataclasses.replace(H100, memory=0)  # a card whose memory the description does not say


@pytest.mark.parametrize("device,expected", [
    (ZEN3, (256, 2048)),  # the CPU: what MILI always had
    (UNKNOWN, (256, 2048)), (L4, (256, 2048)), (RTX_4090, (256, 2048)), (V100_32, (256, 2048)),
    (A100_40, (512, 4096)), (L40S, (512, 4096)),
    (H100_80, (1024, 8192)), (H200, (1024, 8192)),
])
def test_batch_limits_by_the_device(device, expected):
    assert batch_limits(device) == expected
    p = plan(engine(), qwen3(), device)
    assert (p.batch.max_num_seqs, p.batch.max_num_batched_tokens) == expected
    assert p.batch.sized_by == {"max_num_seqs": "device", "max_num_batched_tokens": "device"}
    assert p.memory.max_num_seqs == expected[0]  # (the KV pool and the state slots are sized by it)


def test_the_table_is_ordered_and_its_rows_are_in_the_flags_help():
    for rows in BATCH_LIMITS.values():
        assert [gib for gib, _, _ in rows] == sorted((gib for gib, _, _ in rows), reverse=True) and rows[-1][0] == 0
    seqs_help = options.options(EngineConfig)["max_num_seqs"][1].help
    tokens_help = options.options(EngineConfig)["max_num_batched_tokens"][1].help
    for gib, seqs, tokens in BATCH_LIMITS["cuda"]:  # the help says the table as it is
        assert str(seqs) in seqs_help and str(tokens) in tokens_help
        assert not gib or (f"{gib} GiB" in seqs_help and f"{gib} GiB" in tokens_help)
    (_, seqs, tokens), = BATCH_LIMITS["cpu"]
    assert f"the CPU {seqs}" in seqs_help and f"the CPU {tokens}" in tokens_help


def test_an_explicit_value_always_wins():
    for device in (ZEN3, L4, H200):
        p = plan(engine(max_num_seqs=7), qwen3(), device)
        assert (p.batch.max_num_seqs, p.batch.max_num_batched_tokens) == (7, batch_limits(device)[1])
        assert p.batch.sized_by == {"max_num_seqs": "user", "max_num_batched_tokens": "device"}
        p = plan(engine(max_num_batched_tokens=100), qwen3(), device)
        assert (p.batch.max_num_seqs, p.batch.max_num_batched_tokens) == (batch_limits(device)[0], 100)
        assert p.batch.sized_by == {"max_num_seqs": "device", "max_num_batched_tokens": "user"}
    both = plan(engine(max_num_seqs=2000, max_num_batched_tokens=256), qwen3(), H200)  # (above the table too)
    assert (both.batch.max_num_seqs, both.batch.max_num_batched_tokens) == (2000, 256)
    assert both.describe()["batch"] == "2000 sequences (as asked), 256 tokens a step (as asked)"


def test_the_plan_resolves_the_config_it_was_given():
    config = engine()
    resolved = plan(config, qwen3(), H200).resolve(config)
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (1024, 8192)
    assert config.max_num_seqs is None and config.max_num_batched_tokens is None  # (a new config: this one unchanged)
    assert dataclasses.replace(resolved, max_num_seqs=None, max_num_batched_tokens=None) == config
    # planning the resolved config again (a tensor-parallel rank's) chooses the same
    again = plan(resolved, qwen3(), H200).batch
    assert (again.max_num_seqs, again.max_num_batched_tokens) == (1024, 8192)


def test_the_cuda_graph_ladder_is_the_plans_and_stops_at_512():
    big = plan(engine(), qwen3(), H200)
    assert big.step is StepKind.CUDA_GRAPHS and big.batch.graph_sizes == graph_batch_sizes(1024)
    assert big.batch.graph_sizes[-1] == MAX_GRAPH_BATCH == 512 and big.batch.graph_sizes[:5] == (1, 2, 4, 8, 16)
    assert "decode batches of 1 to 512 sequences; larger ones eagerly" in big.describe()["step"]
    small = plan(engine(), qwen3(), L4)
    assert small.batch.graph_sizes[-1] == 256 and "larger" not in small.describe()["step"]
    assert plan(engine(max_num_seqs=20), qwen3(), H200).batch.graph_sizes == (1, 2, 4, 8, 16, 20)
    assert "batches" not in plan(engine(), qwen3(), ZEN3).describe()["step"]  # (no graphs on the CPU)


def test_the_description_shows_the_values_and_where_they_came_from():
    rows = plan(engine(), qwen3(), H200).describe()
    assert rows["batch"] == "1024 sequences (by the device), 8192 tokens a step (by the device)"
    assert rows["device"] == f"cuda (NVIDIA H200, {H200.memory / GIB:.1f} GiB)"
    assert plan(engine(), qwen3(), ZEN3).describe()["batch"] == ("256 sequences (by the device), 2048 tokens a step "
                                                                 "(by the device)")


def test_auto_is_the_default_and_can_be_written(tmp_path):
    from mili.cli import build_parser, engine_kwargs
    from mili.config_file import ConfigFileError, read_config_file

    assert EngineConfig("m").max_num_seqs is None and EngineConfig("m").max_num_batched_tokens is None
    assert EngineConfig("m", max_num_seqs="auto", max_num_batched_tokens="AUTO").max_num_seqs is None
    with pytest.raises(InvalidRequest, match="max_num_seqs must be a positive integer, got 0"):
        EngineConfig("m", max_num_seqs=0)
    with pytest.raises(InvalidRequest, match="max_num_batched_tokens must be a positive integer, got 'lots'"):
        EngineConfig("m", max_num_batched_tokens="lots")
    parser = build_parser()
    kwargs = engine_kwargs(parser.parse_args(["serve", "--max-num-seqs", "auto", "--max-num-batched-tokens", "64"]))
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (None, 64)
    assert engine_kwargs(parser.parse_args(["serve"]))["max_num_seqs"] is None
    for text, expected in [("inference:\n  max_batch_size: auto\n", {"max_num_seqs": None}),
                           ("max_num_batched_tokens: null\n", {"max_num_batched_tokens": None}),
                           ("inference:\n  max_batch_size: 64\nmax_num_batched_tokens: 512\n",
                            {"max_num_seqs": 64, "max_num_batched_tokens": 512})]:
        (tmp_path / "c.yaml").write_text(text)
        assert read_config_file(str(tmp_path / "c.yaml"), parser.serve_parser)[0] == expected
    for text in ("inference:\n  max_batch_size: 0\n", "max_num_batched_tokens: many\n",
                 "max_num_batched_tokens: true\n"):
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ConfigFileError, match="must be a positive integer or auto"):
            read_config_file(str(tmp_path / "bad.yaml"), parser.serve_parser)


@pytest.fixture
def small_cpu_row(monkeypatch):
    """The CPU's row of the table made small, so values the plan chose differ from any default."""
    monkeypatch.setitem(plan_module.BATCH_LIMITS, "cpu", ((0, 5, 40),))


def test_the_chosen_values_reach_the_scheduler_and_the_api_side(tiny_checkpoint, small_cpu_row):
    llm = LLM(str(tiny_checkpoint), dtype="float32")
    core = engine_core(llm)
    assert (core.scheduler.max_num_seqs, core.scheduler.max_num_batched_tokens) == (5, 40)
    assert (core.config.max_num_seqs, core.config.max_num_batched_tokens) == (5, 40)
    assert (llm.engine.config.max_num_seqs, llm.engine.config.max_num_batched_tokens) == (5, 40)  # (the API side's)
    assert core.plan.batch.sized_by == {"max_num_seqs": "device", "max_num_batched_tokens": "device"}
    with pytest.raises(InvalidRequest, match=r"n \(6\) exceeds max_num_seqs \(5\)"):
        llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(n=6, max_tokens=2), use_tqdm=False)
    # it runs within them: 8 requests, at most 5 sequences and 40 tokens a step (a 60-token prompt is chunked)
    outs = llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (60, *range(1, 8))],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3] * 8
    llm.engine.check_integrity()
    asked = LLM(str(tiny_checkpoint), dtype="float32", max_num_seqs=3).engine
    scheduler = engine_core(asked).scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (3, 40)
    assert asked.config.max_num_seqs == 3 and asked.info.sized_by == {"max_num_seqs": "user",
                                                                              "max_num_batched_tokens": "device"}


def test_unchanged_on_the_cpu(tiny_checkpoint):
    engine_ = LLM(str(tiny_checkpoint), dtype="float32").engine
    scheduler = engine_core(engine_).scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (256, 2048)


def test_health_shows_the_chosen_values_and_their_source(tiny_checkpoint, small_cpu_row):
    from mili.engine.async_llm import AsyncLLM
    from mili.server.app import build_app

    engine_ = AsyncLLM(EngineConfig(model=str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=64),
                       core_in_thread=True)
    try:
        with TestClient(build_app(engine_, "tiny")) as c:
            health = c.get("/health").json()
            assert health["status"] == "healthy" and health["scheduler_ready"] is True  # (the old fields stay)
            assert (health["max_num_seqs"], health["max_num_batched_tokens"]) == (5, 64)
            assert health["batch_limits_from"] == {"max_num_seqs": "device", "max_num_batched_tokens": "user"}
            assert health["execution_plan"]["batch"] == "5 sequences (by the device), 64 tokens a step (as asked)"
            schema = c.get("/openapi.json").json()
            assert '"maximum": 5' in json.dumps(schema)  # n's runtime maximum: the chosen max_num_seqs
            r = c.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "n": 6})
            assert r.status_code == 400 and "exceeds max_num_seqs (5)" in r.json()["error"]["message"]
            assert c.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "n": 5}).status_code == 200
        scheduler = engine_core(engine_).scheduler
        assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (5, 64)
    finally:
        engine_.shutdown()

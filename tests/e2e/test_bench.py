"""mili bench, all three modes, small: each prints its table (serve against a real server)."""

from __future__ import annotations

import json

from mili.cli import main


def test_bench_latency_and_throughput_with_hf_baseline(random_model, capsys):
    assert main(["bench", "latency", str(random_model), "--dtype", "float32", "--input-len", "16",
                 "--output-len", "4", "--repeat", "1", "--baseline", "hf", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "| mili" in out and "| HF transformers" in out and "roofline" in out and "mili / HF" in out
    assert main(["bench", "throughput", str(random_model), "--dtype", "float32", "--num-requests", "4",
                 "--min-input", "8", "--max-input", "16", "--min-output", "2", "--max-output", "4",
                 "--baseline", "hf", "--hf-sequential-sample", "2", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "mili (continuous batching)" in out and "HF one padded batch" in out
    assert "tok/s of decode in aggregate" in out


def test_bench_prints_the_acceptance_rate(random_model, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 64}'
    assert main(["bench", "throughput", str(random_model), "--dtype", "float32", "--num-requests", "4",
                 "--min-input", "8", "--max-input", "16", "--min-output", "12", "--max-output", "16",
                 "--max-model-len", "256", "--speculative-config", spec]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding (ngram):" in out and "acceptance rate" in out, out

def test_bench_latency_int8_against_bf16_in_one_run(random_model, capsys):
    assert main(["bench", "latency", str(random_model), "--dtype", "bfloat16", "--quantization", "int8",
                 "--input-len", "16", "--output-len", "4", "--repeat", "1", "--baseline", "bf16",
                 "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "| mili (int8)" in out and "| mili (bf16)" in out and "mili / mili (bf16): decode" in out


def test_bench_serve(server, capsys, tmp_path):
    assert main(["bench", "serve", "--url", server.url, "--num-prompts", "6", "--max-concurrency", "3",
                 "--random-input-len", "12", "--random-output-len", "5", "--save-result",
                 str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert all(f"| {m}" in out for m in ("ttft", "tpot", "itl", "e2e")) and "output tok/s" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["output_tokens"] == 30
    assert result["ttft"]["median_ms"] > 0 and result["e2e"]["p99_ms"] >= result["e2e"]["median_ms"]
    cpu = result["cpu_us_per_token"]  # each process's CPU (from /proc) over the streamed tokens
    assert all(cpu[name] > 0 for name in ("api", "core", "client")), cpu
    assert "CPU per streamed output token: API process " in out and " µs, engine core " in out


def test_bench_serve_poisson_rate(server, capsys):
    assert main(["bench", "serve", "--url", server.url, "--num-prompts", "4", "--request-rate", "20",
                 "--random-input-len", "8", "--random-output-len", "3"]) == 0
    assert "4 completed, 0 failed" in capsys.readouterr().out

"""`mili selftest --device cpu --quick` (what CI runs): its table has every section, passes here, and a
failure makes it exit 1."""

from __future__ import annotations

import torch

from mili.tools import selftest
from mili.cli import main
from mili.kernels import cpu


def test_selftest_cpu_quick_passes_and_prints_one_table(capsys):
    assert main(["selftest", "--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    for row in ("torch / triton / transformers", "CPU flags", "MILI CPU kernels", "dense, greedy vs HF",
                "MoE, greedy vs HF", "hybrid Qwen3.5, greedy vs HF", "replay == eager", "copy roofline",
                "decode batch 1", "0 failed", "execution plan (demo)", "cpu-decode" if cpu.available() else "eager"):
        assert row in out, row
    assert "| FAIL" not in out
    if not cpu.available():  # this CPU's case: said, and not a failure
        assert "unavailable:" in out and "the torch path runs" in out


def test_a_failed_check_makes_it_exit_1(monkeypatch, capsys):
    def broken(path, device, **kw):
        raise RuntimeError("deliberately broken")

    monkeypatch.setattr("mili.tools.selftest.parity.greedy_parity", broken)
    monkeypatch.setattr("mili.tools.selftest.speed.measure", lambda *a: [("x", "y")])
    assert selftest.main("cpu", quick=True) == 1
    out = capsys.readouterr().out
    assert "| FAIL" in out and "deliberately broken" in out and "1 failed" not in out  # the 3 parity rows fail
    assert "3 failed" in out


def test_the_hybrid_row_sees_a_different_model(tmp_path, monkeypatch):
    """Its teacher-forced comparison fails against another hybrid (another seed) as HF's reference (the row
    passes against its own: the test above); on a device MILI does not run hybrids on it is a skip."""
    import transformers

    from mili.tools.selftest import parity

    other = parity.build(tmp_path / "other", "hybrid", seed=1)
    if not torch.cuda.is_available():
        assert parity.hybrid_parity(tmp_path / "on_cuda", "cuda")[0] is None
    load = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        staticmethod(lambda path, **kw: load(other, **kw)))
    ok, detail = parity.hybrid_parity(tmp_path / "ours", "cpu")
    assert not ok and "without a near-tie" in detail

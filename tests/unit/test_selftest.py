"""`mili selftest --device cpu --quick` (what CI runs): its table has every section, passes here, and a
failure makes it exit 1."""

from __future__ import annotations

from mili import selftest
from mili.cli import main
from mili.kernels import cpu


def test_selftest_cpu_quick_passes_and_prints_one_table(capsys):
    assert main(["selftest", "--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    for row in ("torch / triton / transformers", "CPU flags", "MILI CPU kernels", "dense, greedy vs HF",
                "MoE, greedy vs HF", "replay == eager", "copy roofline", "decode batch 1", "0 failed"):
        assert row in out, row
    assert "| FAIL" not in out
    if not cpu.available():  # this CPU's case: said, and not a failure
        assert "unavailable:" in out and "the torch path runs" in out


def test_a_failed_check_makes_it_exit_1(monkeypatch, capsys):
    def broken(path, device, **kw):
        raise RuntimeError("deliberately broken")

    monkeypatch.setattr("mili.selftest.parity.greedy_parity", broken)
    monkeypatch.setattr("mili.selftest.speed.measure", lambda *a: [("x", "y")])
    assert selftest.main("cpu", quick=True) == 1
    out = capsys.readouterr().out
    assert "| FAIL" in out and "deliberately broken" in out and "1 failed" not in out  # both parity rows fail
    assert "2 failed" in out

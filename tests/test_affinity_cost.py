"""The affinity cost benchmark runs and reports its figures (no timing is asserted)."""

from __future__ import annotations

import re

import pytest

from loadtest import affinity_cost


def test_measure_covers_a_16k_token_prompt_over_16_full_indexes() -> None:
    """measure() hashes a 64 KiB prompt into 256 blocks and times every step it names."""
    result = affinity_cost.measure(index_blocks=512, number=2, repeat=2)
    assert result["blocks"] == 256
    for key in ("hash_us", "score_us", "least_busy_us", "insert_us", "total_us"):
        assert result[key] > 0, key
    assert result["total_us"] == pytest.approx(
        result["hash_us"] + result["score_us"] + result["insert_us"]
    )
    assert result["index_bytes"] > 512 * 8  # at least a 64-bit hash a block


def test_cli_prints_each_figure(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m loadtest.affinity_cost` prints the per-call figures and the budget verdict."""
    code = affinity_cost.main(["--index-blocks", "256", "--number", "2", "--repeat", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "16 instances" in out
    for label in ("hash prompt text", "least_time", "least_busy", "index insert", "one full index"):
        assert label in out
    verdict = r"hash \+ score \+ insert\s+[\d.]+ us\s+\(budget 1000 us: (within|OVER)\)"
    assert re.search(verdict, out)


def test_cli_refuses_zero_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """A count of zero is a usage error, not a division by zero."""
    with pytest.raises(SystemExit) as exited:
        affinity_cost.main(["--repeat", "0"])
    assert exited.value.code == 2
    assert "at least 1" in capsys.readouterr().err

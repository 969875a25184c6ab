"""bench/fairness.py judges by the configured SLOs unless told otherwise, and says so."""

from __future__ import annotations

from typing import Any

import pytest

from bench.fairness import WEIGHTS, parse_args, summary_line
from workers.fairness.policy import DEFAULT_POLICIES


def run_output(scale: float) -> dict[str, Any]:
    """What main() collects, for the parts that matter to the summary."""
    return {
        "slo_scale": scale,
        "slo_s": {g: DEFAULT_POLICIES[g].slo_p99_s * scale for g in WEIGHTS},
        "sim": {
            "jain_vtc": 0.99999,
            "jain_fcfs": 0.744,
            "light_vtc": {"p99_s": 2.0, "windows_p99_met": 1.0},
            "light_fcfs": {"p99_s": 398.0, "windows_p99_met": 0.0},
        },
    }


def test_default_is_the_configured_slos() -> None:
    assert parse_args([]).slo_scale == "1"
    line = summary_line(run_output(1.0))
    assert line.startswith("fairness: SLOs as configured (de 2 s, fr 3 s, es 4 s, it 6 s)")
    assert "SCALED" not in line
    assert "Jain VTC 1.0000 / FCFS 0.7440" in line and "100% / 0%" in line


def test_a_scale_is_said_in_the_summary_line() -> None:
    line = summary_line(run_output(2.5))
    assert "SLOs SCALED x2.50 by --slo-scale" in line
    assert "it 15 s" in line  # the SLO actually judged against


@pytest.mark.parametrize("bad", ["0", "-1", "x", "inf"])
def test_bad_scales_fail_before_any_work(bad: str) -> None:
    from bench.fairness import main

    with pytest.raises(SystemExit, match="--slo-scale"):
        main(["--slo-scale", bad])

"""bench/cascade_early.py: the figures of early deferral from hand-made rows (the verdicts
compared, the deferred items' tokens and seconds saved), and one real run on Gemma 3."""

from __future__ import annotations

from typing import Any

import pytest

from bench.cascade_early import parse_args, run, summary


def _row(deferred: bool, whole: tuple[int, float], early: tuple[int, float, str]) -> dict[str, Any]:
    return {
        "group": "bcontrast:en-de",
        "deferred": deferred,
        "whole": {"finish": "stop", "tokens": whole[0], "seconds": whole[1]},
        "early": {"finish": early[2], "tokens": early[0], "seconds": early[1]},
    }


def test_the_summary_counts_verdicts_and_what_the_deferred_items_saved() -> None:
    rows = [
        _row(True, (20, 1.0), (5, 0.25, "below")),  # deferred, stopped after 5 tokens
        _row(True, (10, 0.5), (10, 0.5, "stop")),  # deferred whole, not stopped: a mismatch
        _row(False, (8, 0.4), (8, 0.4, "stop")),  # kept: the same run
    ]
    out = summary(rows)
    assert out["items"] == 3 and out["deferred_share"] == 0.667
    assert out["same_verdict"] == 2
    assert out["deferred"]["tokens"] == {"whole": 30, "early": 15}
    assert out["deferred"]["tokens_saved_share"] == 0.5
    assert out["deferred"]["seconds_mean"] == {"whole": 0.75, "early": 0.375}
    assert out["deferred"]["seconds_saved_share"] == 0.5
    assert out["all_seconds_mean"] == {"whole": 0.6333, "early": 0.3833}
    assert "deferred" not in summary([rows[2]])


@pytest.mark.slow
def test_gemma_early_runs_give_the_whole_runs_verdicts() -> None:
    """Real weights, two support turns each way: every early verdict is the whole answer's,
    and an early run never decodes more than the whole one."""
    result = run(parse_args(["--bcontrast", "2", "--flores", "0"]))
    assert result["all"]["items"] == 4
    assert result["all"]["same_verdict"] == 4
    for row in result["rows"]:
        assert row["early"]["tokens"] <= row["whole"]["tokens"]
        if row["early"]["finish"] == "below":
            assert row["early"]["total"] < row["threshold"]

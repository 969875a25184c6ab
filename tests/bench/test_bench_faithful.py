"""bench/faithful.py's bookkeeping without a model: the items (`--pairs`), and reading an
earlier run's answers back (`--stored VARIANT=PATH`) so a long `before` and a later `after`
report together on the same items; a withheld answer counted apart from the translations sent,
and the flag policy derived from the same run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.faithful import (
    Answer,
    _outputs,
    benchmark_items,
    flag_policy,
    stored_runs,
    summarize,
)


def _write_run(path: Path, rows: Sequence[Sequence[Any]], variant: str = "before") -> str:
    data = {
        "commit": "abc1234",
        "dirty": True,
        "models": {
            "m": {
                "default_form": "f",
                "retry_form": "r",
                "seconds": {variant: 12.5},
                "after_policy": {"checks": {"de/ratio": 1}},
                "outputs": {variant: rows},
            }
        },
    }
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def test_items_cover_both_subsets_and_every_pair() -> None:
    items = benchmark_items(8)
    assert sum(it.subset == "bcontrast" for it in items) == 8
    assert {it.pair for it in items if it.subset == "other"} == {
        "en-fr",
        "en-es",
        "en-it",
        "fr-en",
    }
    assert len(items) == 16  # 8 turns + 2 sentences of each of the 4 other pairs


def test_stored_answers_come_back_for_a_subset_of_the_items(tmp_path: Path) -> None:
    items = benchmark_items(8)
    answers = [Answer(f"t{i}", "stop", i, 30, i == 3) for i in range(len(items))]
    path = _write_run(tmp_path / "after.json", _outputs(items, answers), "after")
    french = [it for it in items if it.pair == "en-fr"]
    got, origin = stored_runs([f"after={path}"], "m", french)
    idx = [i for i, it in enumerate(items) if it.pair == "en-fr"]
    assert [a.text for a in got["after"]] == [f"t{i}" for i in idx]
    assert [(a.tokens, a.cap) for a in got["after"]] == [(i, 30) for i in idx]
    assert origin["after"]["commit"] == "abc1234+dirty"
    assert origin["after"]["policy"] == {"checks": {"de/ratio": 1}}
    assert origin["after"]["seconds"] == 12.5


def test_old_four_column_rows_read_as_unflagged(tmp_path: Path) -> None:
    items = benchmark_items(4)
    rows = [[it.pair, it.source, "x", "length"] for it in items]
    got, _ = stored_runs([f"before={_write_run(tmp_path / 'b.json', rows)}"], "m", items)
    assert all(not a.flagged and a.finish == "length" for a in got["before"])
    summary = summarize(items, got["before"], None)
    assert sum(r["cap_stops"] for r in summary.values()) == len(items)
    assert sum(r["past_cap"] for r in summary.values()) == 0


def test_stored_runs_refuse_other_items_and_a_bare_path(tmp_path: Path) -> None:
    items = benchmark_items(4)
    path = _write_run(tmp_path / "b.json", [[it.pair, it.source, "x", "stop"] for it in items])
    with pytest.raises(SystemExit, match="missing"):
        stored_runs([f"before={path}"], "m", benchmark_items(8))
    with pytest.raises(SystemExit, match="VARIANT=PATH"):
        stored_runs([path], "m", items)


def test_withheld_answers_count_apart_and_the_flag_policy_sends_their_candidates(
    tmp_path: Path,
) -> None:
    items = [it for it in benchmark_items(8) if it.pair == "en-fr"]  # 2 items
    runaway = "Bonjour " * 40  # a ratio outlier and a loop
    answers = [
        Answer("", "withheld", 40, 50, False, withheld=True, candidate=runaway),
        Answer(items[1].reference, "stop", 5, 50, False),
    ]
    row = summarize(items, answers, None)["other:en-fr"]
    assert row["withheld"] == 1 and row["flagged"] == 0
    assert row["ratio_out"] == 0 and row["loop"] == 0  # nothing sent, nothing to count
    flagged = flag_policy(answers)
    assert flagged[0].text == runaway and flagged[0].flagged and not flagged[0].withheld
    assert flagged[1] == answers[1]
    row = summarize(items, flagged, None)["other:en-fr"]
    assert row["withheld"] == 0 and row["flagged"] == 1
    assert row["ratio_out"] == 1 and row["loop"] == 1
    # the columns survive a write and a `--stored` read
    path = _write_run(tmp_path / "after.json", _outputs(items, answers), "after")
    got, _ = stored_runs([f"after={path}"], "m", items)
    assert got["after"] == answers

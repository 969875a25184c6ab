"""The README's performance table (bench/serving_report.py): generated from a committed
`bench.serving` result, never copied by hand (issue #46, Done-when 4)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.serving_report import END_MARK, START_MARK, main, markdown_summary, replace_block

ROOT = Path(__file__).resolve().parents[2]
RESULT = "docs/results/serving.json"


def figures(p50: float | None, p99_ok: float, goodput: float) -> dict[str, Any]:
    return {
        "languages": {
            "all": {
                "p50_s": {"mean": p50},
                "p99_ok_s": {"mean": p99_ok},
                "goodput": {"mean": goodput},
            }
        }
    }


def result() -> dict[str, Any]:
    return {
        "command": "python -m bench.serving --rates 1,2",
        "machine": {"cpu_model": "Test CPU", "logical_cpus": 2, "date_utc": "2026-12-06 17:00"},
        "settings": {"mix": "de=0.5,en=0.5", "slo": 2.0, "duration": 60, "repeats": 2},
        "summary": {
            "tolk": {
                "2": {"total_rate": 2.0, **figures(0.2, 1.0, 0.99)},
                "1": {"total_rate": 1.0, **figures(0.1, 0.5, 1.0)},
            },
            "llama-http": {
                "1": {"total_rate": 1.0, **figures(0.2, 2.0, 0.98)},
                "2": {"total_rate": 2.0, **figures(None, 4.0, 0.5)},
            },
        },
    }


def test_the_table_has_one_row_per_load_with_both_systems_and_their_ratios() -> None:
    table = markdown_summary(result(), "r.json").splitlines()
    assert table[0].startswith("| offered load (de=0.5,en=0.5, open loop) | tolk P50")
    assert "llama-server P50" in table[0] and "goodput at 2 s" in table[0]
    assert table[2] == "| 1 req/s | 0.10 / 0.50 | 0.20 / 2.00 | 0.50x, 0.25x | 100 % / 98 % |"
    # a P50 that fell on a miss is said so, and its ratio is not made up
    assert table[3] == "| 2 req/s | 0.20 / 1.00 | missed / 4.00 | -, 0.25x | 99 % / 50 % |"
    caption = table[-1]
    assert "Test CPU, 2 vCPU, 2026-12-06 17:00 UTC" in caption and "2 repeats" in caption
    assert "from `r.json`" in caption and "`python -m bench.serving --rates 1,2`" in caption


def test_a_result_without_the_anchor_is_refused() -> None:
    one = result()
    del one["summary"]["llama-http"]
    with pytest.raises(ValueError, match="llama-http"):
        markdown_summary(one, "r.json")


def test_the_block_is_replaced_between_its_markers_and_nowhere_else() -> None:
    text = f"intro\n{START_MARK}: old -->\n| old |\n{END_MARK}\nafter\n"
    out = replace_block(text, "| new |", "r.json")
    assert out == (
        f"intro\n{START_MARK}: python -m bench.serving_report --markdown r.json -->\n"
        f"| new |\n{END_MARK}\nafter\n"
    )
    with pytest.raises(ValueError, match="no "):
        replace_block("no markers here", "| new |", "r.json")


def test_the_command_writes_the_readme_block(tmp_path: Path, capsys: Any) -> None:
    source = tmp_path / "r.json"
    source.write_text(json.dumps(result()))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{START_MARK} -->\n{END_MARK}\n")
    assert main(["--markdown", str(source), "--readme", str(readme)]) == 0
    assert "| 1 req/s | 0.10 / 0.50 |" in readme.read_text()
    assert "| 1 req/s |" in capsys.readouterr().out


def test_the_readme_table_is_what_the_committed_result_gives() -> None:
    """Run `python -m bench.serving_report --markdown docs/results/serving.json --readme
    README.md` after replacing the JSON; a table edited by hand fails here."""
    committed = json.loads((ROOT / RESULT).read_text())
    readme = (ROOT / "README.md").read_text()
    table = markdown_summary(committed, RESULT)
    assert replace_block(readme, table, RESULT) == readme
    # and the table is on the README's first screen (issue #46: about 60 lines)
    first_screen = "\n".join(readme.splitlines()[:70])
    assert table.splitlines()[2] in first_screen

"""The per-language mix of real support texts a load test sends.

For a target language L: every row of the shipped sample (`workers/data/support_sample.jsonl`,
BConTrasT and WMT chat turns with their source language) whose target is L, then, so that
each language gets a varied mix, the sample's English rows sent to L (for L = en: its German
rows), then BConTrasT dev utterances from `data/` (German customers to en, English agents to
de and the other languages) when that directory is there. Order is fixed, then shuffled by a
seed, so two runs with one seed send the same texts in the same order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LoadText", "SUPPORT_SAMPLE", "support_mix"]

SUPPORT_SAMPLE = Path(__file__).resolve().parent.parent / "data" / "support_sample.jsonl"


@dataclass(frozen=True, slots=True)
class LoadText:
    source_lang: str
    text: str


def _sample_rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _bcontrast_rows(limit: int) -> list[dict[str, str]]:
    try:
        from replay.datasets import DataNotFoundError, bcontrast
    except ImportError:  # pragma: no cover - replay is part of the package
        return []
    rows: list[dict[str, str]] = []
    try:
        for u in bcontrast("dev"):
            rows.append(
                {"source_lang": u.source_lang, "target_lang": u.target_lang, "text": u.source}
            )
            if len(rows) >= limit:
                break
    except (DataNotFoundError, OSError):
        return []
    return rows


def support_mix(
    target_lang: str,
    *,
    seed: int = 0,
    sample: Path = SUPPORT_SAMPLE,
    with_bcontrast: bool = True,
    bcontrast_limit: int = 400,
) -> list[LoadText]:
    """Texts to send to `target_lang` (never empty for a language with any English or German
    row); duplicates removed, shuffled by `seed`."""
    rows = _sample_rows(sample)
    if with_bcontrast:
        rows += _bcontrast_rows(bcontrast_limit)
    pivot = "de" if target_lang == "en" else "en"
    picked: list[LoadText] = []
    seen: set[str] = set()
    for row in rows:  # the rows that target the language first, then the pivot language's
        if row["target_lang"] == target_lang and row["source_lang"] != target_lang:
            _add(picked, seen, row)
    for row in rows:
        if row["source_lang"] == pivot:
            _add(picked, seen, row)
    random.Random(f"{seed}:{target_lang}").shuffle(picked)
    return picked


def _add(picked: list[LoadText], seen: set[str], row: dict[str, str]) -> None:
    text = row["text"].strip()
    if text and text not in seen:
        seen.add(text)
        picked.append(LoadText(row["source_lang"], text))

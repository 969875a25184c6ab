"""bench/tm_prompt.py's items and statistics, and bench/tm.py's memory study on a small index
(no model: the real runs are in docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.tm import memory_study
from bench.tm_prompt import dev_items, percentiles_ms, summarize
from workers.engine.types import FinishReason, GenerationResult


def test_dev_items_are_the_first_turns_of_each_direction_in_order() -> None:
    from replay.datasets import bcontrast

    items = dev_items(5)
    assert [it.pair for it in items].count("en-de") == 5
    assert [it.pair for it in items].count("de-en") == 5
    turns = list(bcontrast("dev"))
    first_de = [u.source for u in turns if u.source_lang == "de"][:5]
    assert [it.source for it in items if it.source_lang == "de"] == first_de


def test_percentiles_are_in_milliseconds() -> None:
    got = percentiles_ms([0.001] * 99 + [0.1])
    assert got["p50_ms"] == 1.0 and got["n"] == 100
    assert 1.0 < got["p99_ms"] <= 100.0


def _results(texts: list[str]) -> list[GenerationResult]:
    return [
        GenerationResult(f"r{i}", [1], t, FinishReason.STOP, tokens_in=10, cached_tokens=4)
        for i, t in enumerate(texts)
    ]


def test_summary_scores_each_variant_against_the_fixed_examples() -> None:
    items = dev_items(30)
    refs = [it.reference for it in items]
    wrong = ["xyz qqq" for _ in items]
    results: dict[str, Any] = {
        "fixed": _results(wrong),
        "retrieved": _results(refs),  # the references themselves: chrF 100
        "retrieved_only": _results(wrong),
    }
    got = summarize(items, results)
    for pair in ("en-de", "de-en"):
        assert got[f"{pair}/retrieved"]["chrF"] == 100.0
        low = got[f"{pair}/retrieved"]["chrF_delta"][1]
        assert low > 0 and got[f"{pair}/retrieved"]["verdict"] == "better"
        same = got[f"{pair}/retrieved_only"]
        assert same["chrF_delta"] == [0.0, 0.0, 0.0]
        assert same["verdict"] == "no detectable difference"
        assert "chrF_delta" not in got[f"{pair}/fixed"]
        assert got[f"{pair}/fixed"]["prompt_tokens_mean"] == 10.0


@pytest.mark.slow  # trains an IVF-PQ and starts six faiss processes
def test_memory_study_splits_private_and_mapped_pages(tmp_path: Path) -> None:
    import faiss

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((4000, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(32)
    flat.add(vectors)
    faiss.write_index(flat, str(tmp_path / "all.flat.faiss"))
    np.save(tmp_path / "all.queries.npy", vectors[:20] + 0.01)
    study = memory_study(tmp_path / "all.flat.faiss", tmp_path / "all.queries.npy", tmp_path)
    assert study["vectors"] == 4000 and study["index_bytes"] > study["inverted_list_bytes"] > 0
    for row in study["rows"]:
        touched, nlist = (int(v) for v in row["lists_touched"].split("/"))
        assert 0 < touched <= nlist and row["list_bytes_touched"] > 0
        assert 0.0 <= row["recall_at_10"] <= 1.0
        # a full read copies the lists into private memory; the mapped one leaves them mapped
        assert row["mmap"]["after_load"]["RssAnon"] < row["full"]["after_load"]["RssAnon"]

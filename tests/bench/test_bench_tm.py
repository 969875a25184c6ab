"""bench/tm.py's corpus and recall arithmetic (no embedding: the full run is in BENCHMARKS)."""

from __future__ import annotations

import numpy as np

from bench.tm import _recalls, parallel_corpus


def test_corpus_has_every_language_pair_with_distinct_sources() -> None:
    corpus = parallel_corpus()
    assert len(corpus) == 20  # every ordered pair of en, de, fr, es, it
    assert len(corpus[("en", "de")]) > len(corpus[("en", "fr")]) > len(corpus[("fr", "es")])
    for texts in corpus.values():
        assert len(texts) == len(set(texts))
        assert all(t == " ".join(t.split()) and t for t in texts)


def test_recalls_against_the_flat_anchor() -> None:
    flat = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    approx = np.array([[1, 3, 9, 9], [6, 5, 9, 9]])
    got = _recalls(flat, approx, k=4)
    assert got["recall_at_1"] == 0.5  # only the first query's first hit agrees
    assert got["recall_at_4"] == 0.5  # 2 of 4 in both queries
    assert got["one_recall_at_4"] == 1.0  # flat's first hit is in both top-4s

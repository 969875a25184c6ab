"""bench/cache.py's per-direction figures (no Kafka: the replies are built here).

The cache benchmark once grouped its figures by target language, and docs/BENCHMARKS.md then
gave each direction's first-pass hit rate under the other direction's name (the 862 customer
turns are de->en, the 1,040 agent turns en->de). The figures are now keyed by direction
(`source->target`); these tests pin that on the real BConTrasT dev split and on a mix where the
two directions' hit rates differ.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.cache import pass_figures
from replay.datasets import bcontrast


def _reply(i: int, source: str, target: str, how: str) -> dict[str, Any]:
    return {
        "request_id": f"r{i}",
        "status": "OK",
        "text": "x",
        "source_lang": source,
        "target_lang": target,
        "metadata": {"tolk.cache": how},
        "timings": {"total_ms": 3.0, "queue_ms": 1.0},
    }


def test_bcontrast_dev_directions_are_named_by_source_and_target() -> None:
    turns = list(bcontrast("dev"))
    speakers = Counter((u.speaker, u.source_lang, u.target_lang) for u in turns)
    assert speakers == {("customer", "de", "en"): 862, ("agent", "en", "de"): 1040}
    replies = [_reply(i, u.source_lang, u.target_lang, "miss") for i, u in enumerate(turns)]
    figures = pass_figures(replies)
    assert set(figures["per_direction"]) == {"de->en", "en->de"}
    assert figures["per_direction"]["de->en"]["requests"] == 862  # the customers' turns
    assert figures["per_direction"]["en->de"]["requests"] == 1040  # the agents'
    assert figures["all"]["requests"] == 1902


def test_each_directions_hits_are_counted_under_that_direction() -> None:
    replies = [_reply(i, "de", "en", "l1" if i < 3 else "miss") for i in range(10)]  # 30 %
    replies += [_reply(10 + i, "en", "de", "l2" if i < 1 else "miss") for i in range(4)]  # 25 %
    replies.append(_reply(99, "en", "fr", "joined"))
    per = pass_figures(replies)["per_direction"]
    assert per["de->en"] == {
        "requests": 10, "l1": 3, "l2": 0, "joined": 0, "miss": 7, "hit_rate": 0.3,
    }  # fmt: skip
    assert per["en->de"]["hit_rate"] == 0.25 and per["en->de"]["l2"] == 1
    assert per["en->fr"] == {
        "requests": 1, "l1": 0, "l2": 0, "joined": 1, "miss": 0, "hit_rate": 0.0,
    }  # fmt: skip

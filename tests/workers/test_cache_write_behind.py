"""`workers.stages.cache.write_behind.WriteBehind`: writes leave the caller's thread, a full queue
drops
and reports, a failing write does not stop the writer, `stop` lets queued writes finish.

The cache engine on real Redis through it: test_cache_redis.py and test_cache_outage.py.
"""

from __future__ import annotations

import threading

import pytest

from tests.workers.polling import wait_for
from workers.stages.cache.key import CacheKey, cache_key
from workers.stages.cache.write_behind import WriteBehind


def _key(text: str) -> CacheKey:
    return cache_key(
        engine_fingerprint="fp", prompt_set_version="p1", source_lang="de", target_lang="en",
        text=text,
    )  # fmt: skip


def test_writes_run_on_the_writer_thread_in_order() -> None:
    seen: list[tuple[str, str]] = []
    writer = WriteBehind(lambda key, text: seen.append((text, threading.current_thread().name)))
    try:
        for text in ("a", "b", "c"):
            writer.write(_key(text), text.upper())
        assert writer.flush(5.0)
        assert [text for text, _ in seen] == ["A", "B", "C"]
        assert {name for _, name in seen} == {"tolk-cache-writer"}
    finally:
        writer.stop()


def test_a_full_queue_drops_the_write_and_reports_it() -> None:
    release = threading.Event()
    dropped: list[int] = []
    written: list[str] = []

    def slow_put(key: CacheKey, text: str) -> None:
        release.wait(5.0)
        written.append(text)

    writer = WriteBehind(slow_put, on_dropped=lambda: dropped.append(1), capacity=2)
    try:
        writer.write(_key("1"), "1")  # taken by the thread, which then waits
        wait_for(lambda: writer._writes.qsize() == 0, what="the first write taken")
        writer.write(_key("2"), "2")
        writer.write(_key("3"), "3")  # the queue holds 2 and 3
        writer.write(_key("4"), "4")  # no room: dropped, and the call did not block
        assert dropped == [1]
        release.set()
        assert writer.flush(5.0)
        assert written == ["1", "2", "3"]
    finally:
        release.set()
        writer.stop()


def test_a_failing_write_is_logged_and_the_next_ones_still_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    written: list[str] = []

    def put(key: CacheKey, text: str) -> None:
        if text == "bad":
            raise RuntimeError("boom")
        written.append(text)

    writer = WriteBehind(put)
    try:
        for text in ("ok1", "bad", "ok2"):
            writer.write(_key(text), text)
        assert writer.flush(5.0)
        assert written == ["ok1", "ok2"]
        assert "a cache write failed" in caplog.text and "boom" in caplog.text
    finally:
        writer.stop()


def test_stop_lets_the_queued_writes_finish_and_a_later_write_starts_a_new_thread() -> None:
    written: list[str] = []
    writer = WriteBehind(lambda key, text: written.append(text))
    for text in ("a", "b"):
        writer.write(_key(text), text)
    writer.stop()
    assert written == ["a", "b"]
    writer.write(_key("c"), "c")
    assert writer.flush(5.0) and written == ["a", "b", "c"]
    writer.stop()

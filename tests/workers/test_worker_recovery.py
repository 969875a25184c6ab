"""The worker rides out faults without losing or double-answering a request (in-memory Kafka,
fake engine): a rewind (seek) that fails, partitions revoked while their requests are in the
engine, and poison requests that make the engine's step raise.

Each of these failed before the fix it tests: a failed seek let the over-quota record through
anyway, results of revoked partitions were answered next to the new owner's answer, and an
engine failure was answered ERROR at once (with every request of the failed batch).
"""

from __future__ import annotations

import time
from typing import Any

from schemas.codec import decode_result
from tests.workers.fakes import POISON_ERROR, POISON_MARKER, FakeEngine, fake_translation
from tests.workers.polling import wait_for
from tests.workers.test_worker_fake_engine import make_rig, request_bytes
from topics.catalog import REPLIES, request_topic
from workers.fairness.policy import DEFAULT_POLICIES, LanguagePolicy


def _stop(rig: Any) -> None:
    rig.worker.stop()
    rig.thread.join(10)
    assert not rig.thread.is_alive()


# -- a rewind that fails --------------------------------------------------------------------


def test_failed_seek_holds_the_partition_and_nothing_is_skipped_or_taken_twice() -> None:
    policies = dict(DEFAULT_POLICIES)
    policies["de"] = LanguagePolicy(weight=4.0, slo_p99_s=2.0, max_queue=4, max_new_tokens=64)
    r = make_rig(policies=policies)
    try:
        wait_for(lambda: r.worker._consumer is not None, what="consumer")
        consumer = r.worker._consumer
        consumer.fail_seeks = 2  # the rewind fails twice, then works
        r.engine.hold()
        for i in range(7):  # one partition (same key), one consume(): 4 fit the quota
            r.send(request_bytes(f"de{i}", text=f"seek test {i}"), "de", key=b"k")
        wait_for(lambda: r.metric("tolk_worker_seek_failures_total", lang="de") >= 2, what="2")
        time.sleep(0.1)
        assert r.engine.pending() == 4  # the high water: the failed rewind took no record
        assert sorted(r.engine.submitted) == [f"de{i}" for i in range(4)]
        wait_for(lambda: len(consumer.seeks) >= 1, what="the seek retried until it worked")
        ((tp, offset),) = set(consumer.seeks)
        assert tp[0] == request_topic("de") and offset == 4
        r.engine.release()
        wait_for(lambda: r.reply_count() == 7, what="every record answered")
        assert sorted(r.engine.submitted) == [f"de{i}" for i in range(7)]  # each exactly once
        replies = r.replies()
        assert all(replies[f"de{i}"]["status"] == "OK" for i in range(7))
        wait_for(lambda: r.committed() == 7, what="committed past all seven")
    finally:
        _stop(r)


# -- partitions revoked while their requests are in the engine ------------------------------


def test_result_of_a_revoked_partition_is_dropped_and_the_new_owner_answers() -> None:
    r = make_rig(commit_interval_s=0.05)
    try:
        r.engine.hold()
        for i in range(3):
            r.send(request_bytes(f"rv{i}", text=f"revoked {i}"), "de", key=b"k")
        wait_for(lambda: r.engine.pending() == 3, what="3 in the engine")
        consumer = r.worker._consumer
        consumer.schedule_revoke_all()
        wait_for(lambda: r.worker.life.tracker.assigned() == frozenset(), what="revoked")
        r.engine.release()
        wait_for(lambda: r.worker.in_flight() == 0, what="results came back")
        time.sleep(0.1)
        assert r.reply_count() == 0  # not answered: the partition's new owner answers
        assert r.metric("tolk_revoked_answers_total", outcome="dropped") == 3
        assert r.committed() == 0

        consumer.schedule_assign_all()  # the "new owner" (here: this worker again) reads them
        wait_for(lambda: r.reply_count() == 3, what="answered by the owner")
        assert sorted(r.replies()) == ["rv0", "rv1", "rv2"]
        wait_for(lambda: r.committed() == 3, what="committed by the owner")
        assert r.metric("tolk_revoked_answers_total", outcome="answered") == 0
    finally:
        _stop(r)


def test_result_of_a_partition_revoked_and_assigned_back_is_answered() -> None:
    """Revoked and assigned back to this worker (a new assignment generation) before the
    result came: this worker owns the record again, so its result is answered, not dropped.
    (The global cap keeps the re-assigned partitions paused, so the record is not read again
    before the result is in.)"""
    r = make_rig(max_in_flight=2, commit_interval_s=0.05)
    try:
        r.engine.hold()
        for i in range(2):
            r.send(request_bytes(f"back{i}", text=f"back {i}", target="fr"), "fr", key=b"k")
        wait_for(lambda: r.engine.pending() == 2, what="2 in the engine")
        consumer = r.worker._consumer
        parts = r.worker.life.partitions
        first = max(parts.generation(tp) for tp in parts.tracker.assigned())
        consumer.schedule_revoke_all()
        consumer.schedule_assign_all()
        wait_for(
            lambda: min((parts.generation(tp) for tp in parts.tracker.assigned()), default=0)
            > first,
            what="every partition assigned back (a new generation)",
        )
        r.engine.release()
        wait_for(lambda: r.reply_count() >= 2, what="answered")
        assert r.metric("tolk_revoked_answers_total", outcome="answered") == 2
        assert r.metric("tolk_revoked_answers_total", outcome="dropped") == 0
        assert r.engine.submitted == ["back0", "back1"]  # never translated twice
        wait_for(lambda: r.committed() == 2, what="committed")
        # the records read again after the resume are answered with the same bytes
        texts = {decode_result(v)["text"] for _k, v in r.broker.records(REPLIES) if v}
        assert texts == {fake_translation("back 0", "fr"), fake_translation("back 1", "fr")}
    finally:
        _stop(r)


# -- poison requests ------------------------------------------------------------------------


def test_poison_request_is_retried_then_dead_lettered_while_the_rest_flows() -> None:
    r = make_rig(engine=FakeEngine(delay_s=0.05))
    try:
        poison = f"this one kills the step {POISON_MARKER}"
        r.send(request_bytes("good-before", text="same partition before"), "de", key=b"k")
        r.send(request_bytes("poison", text=poison), "de", key=b"k")
        good = {"good-before": ("same partition before", "de")}
        for i in range(6):  # the same partition, and other languages, at the same time
            lang = ("de", "fr", "it")[i % 3]
            text = f"bystander {i}"
            good[f"good{i}"] = (text, lang)
            r.send(request_bytes(f"good{i}", text=text, target=lang), lang, key=b"k")

        wait_for(lambda: len(r.dead_letters()) == 1, what="the poison dead-lettered")
        (dl,) = r.dead_letters()
        assert dl["reason"] == "poison"
        assert POISON_ERROR in dl["exception"]
        assert POISON_MARKER.encode() in dl["original"]
        assert r.engine.submitted.count("poison") == 3  # Settings.max_attempts
        wait_for(lambda: r.reply_count() == len(good) + 1, what="every request answered")
        replies = r.replies()
        # the poison's client is told, after the dead letter, instead of waiting out a timeout
        assert replies["poison"]["status"] == "ERROR"
        assert "poison" in replies["poison"]["error"] and POISON_ERROR in replies["poison"]["error"]
        for rid, (text, lang) in good.items():
            assert replies[rid]["status"] == "OK", replies[rid]
            assert replies[rid]["text"] == fake_translation(text, lang)
        assert r.metric("tolk_engine_retries_total", lang="de") >= 2  # the poison's two retries
        # the other languages' requests were in the poison's failed batches (the fake fails a
        # batch whole, as Engine.results.fail_all) and still got their answer on a later run
        assert r.metric("tolk_engine_retries_total", lang="fr") >= 1
        assert r.metric("tolk_engine_retries_total", lang="it") >= 1
        assert r.metric("tolk_worker_dead_letters_total", reason="poison") == 1
        wait_for(lambda: r.committed() == r.sent(), what="committed past the poison")
    finally:
        _stop(r)


def test_a_failed_run_that_succeeds_on_retry_is_answered_once() -> None:
    """A transient engine failure (the first run fails, the second works) is not an error."""
    failed_once: set[str] = set()

    def fails_first_time(text: str) -> bool:
        if "flaky" in text and text not in failed_once:
            failed_once.add(text)
            return True
        return False

    r = make_rig(engine=FakeEngine(poison=fails_first_time))
    try:
        r.send(request_bytes("flaky", text="flaky one", target="es"), "es")
        wait_for(lambda: r.reply_count() == 1, what="answered")
        assert r.replies()["flaky"]["status"] == "OK"
        assert r.engine.submitted == ["flaky", "flaky"]
        assert r.metric("tolk_engine_retries_total", lang="es") == 1
        assert r.dead_letters() == []
        wait_for(lambda: r.committed() == 1, what="committed")
    finally:
        _stop(r)

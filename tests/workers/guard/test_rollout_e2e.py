"""Canary rollouts end to end on the real broker (issue #14, Done-when 1, 2 and 3), with two arm
workers on the fake engine of tests/workers/fakes.py (in this process) and `tolk guard` in a
subprocess.

* A canary `v2` drilled 3 s slow for German only (`DrillEngine`, the engine of `tolk worker
  --drill-inject-latency de:1.0:3000`), started at 50 % with steps 50, 100: German is rolled
  back (share 0 in the control topic) within 3 windows plus 5 s of the start of its first bad
  window; French keeps its canary and is promoted to 100 %.
* A healthy canary started at 5 % goes 5 -> 25 -> 50 -> 100 % in both languages.
* In both: every request is answered, by exactly one arm (duplicates counted and equal in
  text), and a conversation changes arm no more often than its language's shares changed.

The first scenario with the real engine in two `tolk worker` processes is
tests/faults/test_rollout_real_workers.py.

The arm workers must own their partitions before the rollout starts (30 s); a worker thread
that ends before that (an exception in `Worker.run`, reported by pytest as an unhandled thread
exception) fails the wait at once instead of waiting out the timeout, so the two causes of a
failed wait are told apart (tests/workers/test_arm_worker_startup.py: a start-up failure that
ended the thread before its consumer subscribed, fixed in workers/kafka/arm_control.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from schemas.codec import decode_result, encode_request
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.workers.fakes import FakeEngine, TopicReader
from tests.workers.polling import wait_for
from topics.admin import ensure_topics
from topics.catalog import REPLIES, arm_control_topic, catalog, request_topic, rollout_events_topic
from workers.arms import split_arm
from workers.cli import app
from workers.guard.events import read_events
from workers.kafka.arm_control import read_share_table
from workers.serving.pipeline import ServingOptions, build_served_engine
from workers.settings import Settings
from workers.worker import Worker

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
LANGS = ("de", "fr")


@dataclass
class RolloutRun:
    """What one end-to-end rollout produced."""

    prefix: str
    events: list[dict[str, Any]]
    sent: dict[str, tuple[str, str, float]]  # request id -> (lang, routing key, sent at)
    replies: dict[str, list[dict[str, Any]]]  # request id -> replies
    shares: dict[str, dict[str, float]]  # the control topic at the end
    guard_log: str


def wait_assigned(worker: Worker, thread: threading.Thread, timeout: float) -> None:
    """Until `worker` has its first assignment; fails at once when its thread has ended."""
    end = time.monotonic() + timeout
    while not worker.assigned_event.wait(0.1):
        assert thread.is_alive(), f"{worker.settings.worker_id}: thread ended before assignment"
        assert time.monotonic() < end, f"{worker.settings.worker_id}: no assignment in {timeout}s"


def run_rollout(
    bootstrap: str,
    redis: str,
    tmp: Path,
    *,
    start_args: list[str],
    guard_args: list[str],
    rate_per_lang: float,
    conversations: int | None,
    finished: Callable[[set[tuple[str, str]]], bool],
    drill: str | None = None,
    make_engine: Callable[[], Any] | None = None,
) -> RolloutRun:
    """Start the rollout, the two arms and the guard; send requests until `finished(the
    (language, action) pairs of the events)`; then wait for every answer."""
    run = uuid.uuid4().hex[:8]
    prefix = f"t-roll-{run}."
    kafka = {"bootstrap.servers": bootstrap}
    ensure_topics(bootstrap, catalog(LANGS, partitions=2, prefix=prefix), timeout=30)
    env = {"TOLK_BOOTSTRAP": bootstrap, "TOLK_TOPIC_PREFIX": prefix}

    workers: list[tuple[Worker, threading.Thread]] = []
    for arm in ("stable", "v2"):
        settings = Settings(
            bootstrap=bootstrap,
            redis_url=redis,
            group_id=f"tolk-roll-{run}",
            languages=LANGS,
            topic_prefix=prefix,
            metrics_port=0,
            health_port=0,  # two workers in one process: not both on the default port
            worker_id=f"w-{arm}-{run}",
            arm=arm,
            session_timeout_ms=10_000,
            drain_timeout_s=5.0,
            max_in_flight=4096,
        )
        engine: Any = make_engine() if make_engine else FakeEngine(languages=("en", *LANGS))
        drills = (drill,) if arm == "v2" and drill else ()
        served = build_served_engine(
            engine, ServingOptions.of(settings, faithful=False, drill_latency=drills)
        )  # as `tolk worker --no-faithful --no-cache [--drill-inject-latency ...]` serves it
        worker = Worker(settings, served, registry=CollectorRegistry())
        workers.append((worker, worker.run_in_thread()))
    for worker, thread in workers:
        wait_assigned(worker, thread, timeout=30)
    # the rollout starts once both arms run (no request is sent before the guard is ready)
    started = CliRunner().invoke(app, ["rollout", "start", *start_args], env=env)
    assert started.exit_code == 0, started.output

    log_path = tmp / "guard.log"
    guard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.cli",
            "guard",
            *guard_args,
            "--app-id",
            f"guard-{run}",
            "--metrics-port",
            "0",
            "--datadir",
            str(tmp / "g"),
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=open(log_path, "wb"),  # noqa: SIM115 (the process owns it)
        stderr=subprocess.STDOUT,
    )
    reader = TopicReader(bootstrap, prefix + REPLIES)
    producer = Producer({**kafka, "linger.ms": 5})
    sent: dict[str, tuple[str, str, float]] = {}
    stop = threading.Event()

    def send() -> None:
        i = 0
        while not stop.is_set():
            for lang in LANGS:
                rid = f"{run}-{lang}-{i}"
                conv = f"{lang}-conv-{i % conversations}" if conversations else None
                now = time.time()
                request = {
                    "request_id": rid, "conversation_id": conv, "source_lang": "en",
                    "target_lang": lang, "text": f"turn {i} of {conv or rid}",
                    "created_at": int(now * 1000), "deadline": None,
                    "reply_topic": prefix + REPLIES, "metadata": {},
                }  # fmt: skip
                key = (conv or rid).encode()
                producer.produce(prefix + request_topic(lang), encode_request(request), key=key)
                sent[rid] = (lang, conv or rid, now)
            producer.poll(0)
            i += 1
            time.sleep(1 / rate_per_lang)

    def done() -> bool:
        events = read_events(kafka, rollout_events_topic(prefix))
        return finished({(e["language"], e["action"]) for e in events})

    def answered() -> bool:
        return {decode_result(v)["request_id"] for _, v in list(reader.records)} >= set(sent)

    try:
        wait_for(lambda: b"Ready" in log_path.read_bytes(), 90, "guard ready", interval=0.5)
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        wait_for(done, timeout=150, what="the rollout's end", interval=1.0)
        time.sleep(2.0)  # a little traffic after the last change
        stop.set()
        sender.join(10)
        producer.flush(10)
        wait_for(answered, timeout=60, what="every request answered", interval=0.5)
    finally:
        stop.set()
        guard.send_signal(signal.SIGTERM)
        try:
            guard.wait(20)
        except subprocess.TimeoutExpired:
            guard.kill()
        for worker, _ in workers:
            worker.stop()
        for _, thread in workers:
            thread.join(20)
        reader.close()

    replies: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for _, value in list(reader.records):
        reply = decode_result(value)
        replies[reply["request_id"]].append(reply)
    table = read_share_table(kafka, arm_control_topic(prefix))
    return RolloutRun(
        prefix=prefix,
        events=read_events(kafka, rollout_events_topic(prefix)),
        sent=sent,
        replies=dict(replies),
        shares={lang: dict(s) for lang, s in table.entries.items()},
        guard_log=log_path.read_text(errors="replace"),
    )


def assert_answered_once_by_one_arm(r: RolloutRun, max_switches: dict[str, int]) -> None:
    """Done-when 3: no request lost, one arm per request, duplicates equal in text, and a
    routing key (conversation, else request) changes arm at most as often as its language's
    shares changed."""
    lost = set(r.sent) - set(r.replies)
    two_arms = [
        rid for rid, rs in r.replies.items()
        if len({split_arm(x["model_version"])[1] for x in rs}) > 1
    ]  # fmt: skip
    duplicates = sum(len(rs) - 1 for rs in r.replies.values())
    unequal = [rid for rid, rs in r.replies.items() if len({x["text"] for x in rs}) > 1]
    print(
        f"ROLLOUT sent {len(r.sent)} answered {len(r.replies)} lost {len(lost)} "
        f"duplicates {duplicates} two-arm {len(two_arms)}"
    )
    assert not lost and not two_arms and not unequal
    arms_of: dict[tuple[str, str], list[str]] = defaultdict(list)  # (lang, key) -> arms
    for rid in sorted(r.sent, key=lambda x: r.sent[x][2]):
        lang, key, _ = r.sent[rid]
        arms_of[(lang, key)].append(str(split_arm(r.replies[rid][0]["model_version"])[1]))
    for (lang, key), arms in arms_of.items():
        switches = sum(a != b for a, b in zip(arms, arms[1:], strict=False))
        assert switches <= max_switches[lang], (key, arms)


def test_slow_german_canary_rolls_back_while_french_promotes(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    window_s = 3.0
    r = run_rollout(
        kafka_bootstrap,
        redis_url,
        tmp_path,
        start_args=["--arm", "v2", "--languages", "de,fr", "--share", "50", "--steps", "50,100"],
        guard_args=[
            "--decision",
            "windows",
            "--window-s",
            str(window_s),
            "--min-requests",
            "5",
            "--good-windows",
            "2",
            "--bad-windows",
            "3",
            "--grace-s",
            "1",
        ],  # fmt: skip
        rate_per_lang=8.0,
        conversations=40,
        finished=lambda a: {("de", "ROLLBACK"), ("fr", "COMPLETE")} <= a,
        drill="de:1.0:3000",
    )
    de = [e for e in r.events if e["language"] == "de" and e["window_start"] is not None]
    first_bad = next(e for e in de if e["verdict"] == "bad")
    rollback = next(e for e in de if e["action"] == "ROLLBACK")
    took_s = (rollback["decided_at"] - first_bad["window_start"]) / 1000
    print(
        f"ROLLOUT de rolled back {took_s:.1f} s after the start of its first bad window "
        f"(limit {3 * window_s + 5:.0f} s); reasons: {rollback['reasons']}"
    )
    assert took_s <= 3 * window_s + 5
    fr_actions = [e["action"] for e in r.events if e["language"] == "fr"]
    assert fr_actions.count("COMPLETE") == 1 and "ROLLBACK" not in fr_actions
    assert r.shares["de"] == {"stable": 100.0, "v2": 0.0}
    assert r.shares["fr"] == {"stable": 0.0, "v2": 100.0}
    assert_answered_once_by_one_arm(r, {"de": 1, "fr": 1})
    assert "ROLLBACK de" in r.guard_log and "P99" in r.guard_log


def test_healthy_canary_goes_from_5_to_100_percent_through_the_steps(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    r = run_rollout(
        kafka_bootstrap,
        redis_url,
        tmp_path,
        start_args=["--arm", "v2", "--languages", "de,fr", "--share", "5"],
        guard_args=[
            "--decision",
            "windows",
            "--window-s",
            "2",
            "--min-requests",
            "3",
            "--good-windows",
            "1",
            "--grace-s",
            "1",
        ],  # fmt: skip
        rate_per_lang=40.0,
        conversations=None,  # routed by request id: 5 % of the requests, not of 40 keys
        finished=lambda a: {("de", "COMPLETE"), ("fr", "COMPLETE")} <= a,
    )
    for lang in LANGS:
        steps = [
            e["share_after"] for e in r.events
            if e["language"] == lang and e["action"] in ("START", "PROMOTE", "COMPLETE")
        ]  # fmt: skip
        print(f"ROLLOUT {lang} steps {steps}")
        assert steps == [5.0, 25.0, 50.0, 100.0]
        assert not any(e["action"] == "ROLLBACK" for e in r.events)
        assert r.shares[lang] == {"stable": 0.0, "v2": 100.0}
    assert_answered_once_by_one_arm(r, {"de": 3, "fr": 3})


def test_sequential_guard_judges_a_five_percent_canary(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`tolk guard` in its default sequential mode (issue #29) at the issue's 5 % start, where
    a window holds a few canary replies: German's canary, drilled 3 s slow (over its SLO), is rolled
    back on the step's accumulated evidence; French goes 5 -> 25 -> 50 -> 100 % once its
    non-inferiority is shown and each step has lasted its minimum."""
    r = run_rollout(
        kafka_bootstrap,
        redis_url,
        tmp_path,
        start_args=["--arm", "v2", "--languages", "de,fr", "--share", "5"],
        guard_args=[
            "--window-s",
            "2",
            "--grace-s",
            "1",
            "--min-step-s",
            "4",
            "--max-rate-increase",
            "0.2",
            "--max-slow-increase",
            "0.2",
        ],  # fmt: skip
        rate_per_lang=40.0,
        conversations=None,  # routed by request id: 5 % of the requests
        finished=lambda a: {("de", "ROLLBACK"), ("fr", "COMPLETE")} <= a,
        drill="de:1.0:3000",
    )
    de = [e for e in r.events if e["language"] == "de" and e["window_start"] is not None]
    rollback = next(e for e in de if e["action"] == "ROLLBACK")
    figures = rollback["figures"]
    print(f"ROLLOUT de rolled back after {figures['step_canary_requests']:g} canary replies")
    assert rollback["share_before"] == 5.0 and figures["slow_diff_lower"] > 0.2
    assert all(e["action"] in ("HOLD", "ROLLBACK") for e in de)
    steps = [
        e["share_after"] for e in r.events
        if e["language"] == "fr" and e["action"] in ("START", "PROMOTE", "COMPLETE")
    ]  # fmt: skip
    assert steps == [5.0, 25.0, 50.0, 100.0]
    assert r.shares["de"] == {"stable": 100.0, "v2": 0.0}
    assert r.shares["fr"] == {"stable": 0.0, "v2": 100.0}
    assert_answered_once_by_one_arm(r, {"de": 1, "fr": 3})

"""bench/soak.py's counting (`bench/soak_report.py`) and its guards; the harness itself runs
for minutes against the local stack (its short run's figures are in docs/BENCHMARKS.md)."""

from __future__ import annotations

import signal

import pytest

from bench.soak import _check_loopback, parse_args
from bench.soak_report import Tally, classify_exit, report

DUMP = "log line\nFatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first)"


def test_a_native_crash_is_a_fatal_signal_or_a_faulthandler_dump() -> None:
    assert classify_exit(-signal.SIGSEGV, "")["native_crash"]
    assert classify_exit(-signal.SIGABRT, "")["native_crash"]
    dumped = classify_exit(1, DUMP)
    assert dumped["native_crash"]
    assert dumped["fatal_excerpt"][0] == "Fatal Python error: Segmentation fault"
    assert not classify_exit(0, "worker stopped")["native_crash"]
    assert not classify_exit(-signal.SIGTERM, "")["native_crash"]  # stopped while loading
    assert not classify_exit(-signal.SIGKILL, "")["native_crash"]


def test_report_counts_unanswered_duplicates_and_unexpected_exits() -> None:
    t = Tally()
    t.sent = {"a": 0.0, "b": 0.0, "c": 0.0}
    t.replies = {"a": [("w0", "OK")], "b": [("w0", "OK"), ("w1", "OK"), ("w1", "OK")]}
    t.latency_s = [1.0, 2.0]
    t.exits = [
        {**classify_exit(0, ""), "asked_to_stop": True, "killed_by_harness": False},
        {**classify_exit(1, ""), "asked_to_stop": False, "killed_by_harness": False},
        {**classify_exit(-6, DUMP), "asked_to_stop": True, "killed_by_harness": False},
    ]
    r = report(t)
    assert (r["sent"], r["answered"], r["unanswered"]) == (3, 2, 1)
    assert (r["duplicate_replies"], r["duplicated_requests"]) == (2, 1)
    assert (r["native_crashes"], r["unexpected_exits"]) == (1, 1)
    assert r["replies_by_worker"] == {"w0": 2}
    assert r["latency_s"]["max"] == 2.0
    assert r["duplicate_examples"] == {"b": [("w0", "OK"), ("w1", "OK"), ("w1", "OK")]}
    t.errors = {"withheld: too short": 3, "poison": 1}
    assert report(t)["non_ok_errors"] == {"withheld: too short": 3, "poison": 1}


def test_loopback_only_and_sane_arguments() -> None:
    _check_loopback("127.0.0.1:9092,localhost:9093", "redis://127.0.0.1:6379/0")
    with pytest.raises(SystemExit):
        _check_loopback("kafka.example.com:9092", None)
    with pytest.raises(SystemExit):
        _check_loopback("127.0.0.1:9092", "redis://10.0.0.5:6379/0")
    assert parse_args([]).minutes == 30.0
    with pytest.raises(SystemExit):
        parse_args(["--rate", "0"])

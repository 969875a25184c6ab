"""The worker's start-up order (workers/worker_start.py): the background build of the C++ ops
yields to the start-up path (on a 2-vCPU machine never seen, the compiler and the model's
conversion share the cores, and the conversion is what consuming waits for), and the tuner's
first probe waits for the warm-up (what readiness waits for)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from kernels import cpu_ops
from workers import worker_start


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_build_thread_runs_niced_and_the_caller_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, int] = {}
    done = threading.Event()

    def fake_load() -> bool:
        seen["build"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        done.set()
        return True

    monkeypatch.setattr(cpu_ops, "load", fake_load)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker_start._build_cpu_ops_in_background()
    assert done.wait(10)
    assert seen["build"] == min(before + worker_start.BUILD_NICE, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


class _WarmingEngine:
    """The attributes `wait_until_warm` reads, warmed by a timer as the engine loop would."""

    def __init__(self, warm: tuple[str, ...], languages: tuple[str, ...]) -> None:
        self.config = type("Config", (), {"warm_languages": warm})()
        self.languages = languages
        self.warmed_languages: set[str] = set()


def test_the_tuners_first_probe_waits_for_the_warm_up() -> None:
    import time

    engine = _WarmingEngine(("de", "fr", "xx"), ("de", "fr"))  # xx: not served, not waited for
    timers = [
        threading.Timer(0.2, engine.warmed_languages.add, ("de",)),
        threading.Timer(0.4, engine.warmed_languages.add, ("fr",)),
    ]
    for t in timers:
        t.start()
    started = time.monotonic()
    assert worker_start.wait_until_warm(engine, timeout_s=10, poll_s=0.02)
    assert 0.35 < time.monotonic() - started < 5


def test_a_warm_up_that_never_ends_does_not_hold_the_probe_for_good() -> None:
    engine = _WarmingEngine(("de",), ("de",))
    assert not worker_start.wait_until_warm(engine, timeout_s=0.2, poll_s=0.02)

"""The worker's background build of the C++ ops yields to its start-up path
(workers/worker_start.py `_build_cpu_ops_in_background`): on a 2-vCPU machine never seen, the
compiler and the model's conversion share the cores, and the conversion is what consuming
waits for."""

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

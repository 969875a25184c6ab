"""`workers.process_hooks`: stop signals set the worker's stop event; handlers are restored."""

from __future__ import annotations

import os
import signal
import threading

from prometheus_client import Counter

from workers.process_hooks import install_stop_signals, start_metrics_server, worker_registry


def test_sigterm_sets_the_stop_event_and_restore_puts_the_old_handler_back() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    restore = install_stop_signals(stop)
    try:
        assert signal.getsignal(signal.SIGTERM) is not previous
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread, handled at once
        assert stop.wait(2.0)
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_off_the_main_thread_nothing_is_installed() -> None:
    before = signal.getsignal(signal.SIGINT)
    seen: list[object] = []

    def install() -> None:
        restore = install_stop_signals(threading.Event())
        seen.append(signal.getsignal(signal.SIGINT))
        restore()

    t = threading.Thread(target=install)
    t.start()
    t.join(5)
    assert seen == [before]


def test_metrics_server_off_for_port_zero_and_registry_has_process_metrics() -> None:
    registry = worker_registry()
    assert start_metrics_server(0, registry) is None
    Counter("probe_total", "a probe", registry=registry).inc()
    names = {m.name for m in registry.collect()}
    assert "probe" in names and "process_cpu_seconds" in names


def test_seconds_since_process_start_counts_from_the_process_not_the_import() -> None:
    """The start-up time the worker logs: a child process that sleeps before asking reports at
    least that sleep (time since the process began, not since the call)."""
    import subprocess
    import sys

    code = (
        "import time; time.sleep(1.5); "
        "from workers.process_hooks import seconds_since_process_start as s; print(s())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 1.4 <= float(out.stdout.strip()) < 120

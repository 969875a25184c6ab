"""What a worker process hooks into around its poll loop: stop signals and the metrics endpoint.

Kept apart from `workers/worker.py` (the loop, intake, dispatch, rebalances, commits) because
none of it is Kafka logic: SIGTERM/SIGINT set the worker's stop event (the loop then drains,
flushes and commits; handlers can only be installed from the main thread, so a worker run on a
thread in tests or an embedding leaves the process's handlers alone), and Prometheus is served
from the worker's own registry, which carries the process and platform collectors the default
registry would have (several workers may share one test process, each with its registry).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

__all__ = [
    "install_stop_signals",
    "seconds_since_process_start",
    "start_metrics_server",
    "worker_registry",
]

log = logging.getLogger(__name__)


def install_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """Make SIGTERM and SIGINT set `stop`; returns the function that restores the previous
    handlers (a no-op off the main thread, where nothing is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: object) -> None:
        log.info("signal %s: stopping intake and draining", signal.Signals(signum).name)
        stop.set()

    for s in previous:
        signal.signal(s, handler)

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    return restore


def start_metrics_server(port: int, registry: CollectorRegistry) -> Any:
    """Serve `registry` over HTTP on `port`; returns the server (its `shutdown()` stops it), or
    None when `port` <= 0 or the port is taken (logged: a worker runs on without metrics)."""
    if port <= 0:
        return None
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, registry=registry)
    except OSError as exc:
        log.error("metrics port %d unavailable: %s", port, exc)
        return None
    return server


def worker_registry() -> CollectorRegistry:
    """A registry of its own for one worker, with the process and platform collectors."""
    from prometheus_client import PlatformCollector, ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc; None elsewhere): the start-up time
    the worker logs when it begins consuming (imports, model load, compilation included)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after the comm field
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))

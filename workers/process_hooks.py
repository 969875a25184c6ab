"""What a tolk process hooks into: crash dumps, stop signals and the metrics endpoint.

Crash dumps (`enable_crash_dumps`, called once at the CLI edge, the `tolk` app's callback in
`workers/cli.py`, so every subcommand gets it: worker, guard, replay, load, demo, ...): a fatal
signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) in a thread that does not block it (Python's
threads, torch's) makes `faulthandler` write "Fatal Python error: <signal>" and the Python
stack of every thread to stderr before the process dies (by the same signal: a supervisor
still sees the crash). librdkafka's own threads (`rdk:main`, `rdk:broker...`) block every
signal, so a crash there kills the process with no dump at all (and no kernel log line, since
a handler is installed): only a core dump shows it (docs/OPERATIONS.md, "Native crashes").
tolk processes log to stderr (`logging.basicConfig`), so that is their log: the dump lands
between the last log lines.
A dump already switched on (`PYTHONFAULTHANDLER`, `python -X faulthandler`, pytest) is left as
it is; a process whose stderr has no file descriptor (embedded) runs without one.

Kept apart from `workers/worker.py` (the loop, intake, dispatch, rebalances, commits) because
none of it is Kafka logic: SIGTERM/SIGINT set the worker's stop event (the loop then drains,
flushes and commits; handlers can only be installed from the main thread, so a worker run on a
thread in tests or an embedding leaves the process's handlers alone), and Prometheus is served
from the worker's own registry, which carries the process and platform collectors the default
registry would have (several workers may share one test process, each with its registry). Its
port follows workers/ports.py: an explicit port that is taken stops the start; none is dropped
silently.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from workers.ports import DEFAULT_METRICS_PORT, open_server

__all__ = [
    "enable_crash_dumps",
    "install_stop_signals",
    "seconds_since_process_start",
    "start_metrics_server",
    "worker_registry",
]

log = logging.getLogger(__name__)


def enable_crash_dumps() -> bool:
    """Turn `faulthandler` on for every thread, writing to the process's stderr (see the module
    notes); True when a dump is on (this call's or an earlier one's)."""
    if faulthandler.is_enabled():
        return True
    stream = sys.__stderr__
    try:
        if stream is None:
            return False
        stream.fileno()
        faulthandler.enable(file=stream, all_threads=True)
    except (OSError, ValueError, AttributeError) as exc:  # io.UnsupportedOperation: an OSError
        log.debug("no crash dumps: stderr has no file descriptor (%s)", exc)
        return False
    return True


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


def start_metrics_server(
    port: int | None,
    registry: CollectorRegistry,
    *,
    default: int = DEFAULT_METRICS_PORT,
    what: str = "metrics (/metrics)",
    setting: str = "TOLK_METRICS_PORT / --metrics-port",
) -> Any:
    """Serve `registry` over HTTP as the port setting `port` says (workers/ports.py: a number,
    or refuse with `PortUnavailable`; AUTO_PORT; None = `default` else a free one, with a
    warning); returns the server (`server_address[1]` its port, `shutdown()` stops it), or None
    when `port` is 0 (off)."""
    from prometheus_client import start_http_server

    def make(p: int) -> tuple[Any, int]:
        server, _thread = start_http_server(p, registry=registry)
        return server, int(server.server_address[1])

    opened = open_server(make, port, default=default, what=what, setting=setting)
    return None if opened is None else opened[0]


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

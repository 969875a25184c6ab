"""The ports a tolk process listens on (metrics, probes), on a host it may share.

A worker serves Prometheus metrics (`TOLK_METRICS_PORT` / `--metrics-port`, default 9400) and
its probes (`TOLK_HEALTH_PORT`, default 8081); `tolk guard` its metrics (`--metrics-port`,
default 9401). Two of them on one host (the CPU scale-out: one worker per core,
docs/OPERATIONS.md) want the same ports. A port that could not be had used to be logged and
dropped: the second worker ran without probes (or metrics) and nothing else said so. Now a
port setting means one of:

* a number: that port, or refuse to start (`PortUnavailable`, whose message names the setting
  and the ways out; the CLI exits 2). Explicit, so the operator meant it: Kubernetes probes
  and Prometheus scrape configs point at it (the ConfigMap sets both numbers);
* `auto` (`AUTO_PORT`): a free port the kernel picks, logged at INFO ("... on port N") and
  kept on the process (`Worker.metrics_port`, `Worker.health_port`): for several processes on
  one host, e.g. `bench/scale_out.py`;
* not set (`None`): the default port if it is free, else a free one, logged at WARNING with the
  setting to fix it: a second worker started by hand still has its probes and metrics, and says
  where they are;
* `0`: off (no server).

`open_server` applies these to any server factory; `workers/health.py` and
`workers/process_hooks.py` use it. `port_in_use` lets the CLI refuse an explicit port before it
spends a minute loading the model (the bind at start stays the real test: a race between the
two is still refused, only later).
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "AUTO_PORT",
    "DEFAULT_GUARD_METRICS_PORT",
    "DEFAULT_HEALTH_PORT",
    "DEFAULT_METRICS_PORT",
    "PortUnavailable",
    "in_use_message",
    "open_server",
    "parse_port",
    "port_in_use",
    "valid_port_setting",
]

log = logging.getLogger(__name__)

AUTO_PORT = -1  # "auto": a free port, picked when the server starts
DEFAULT_METRICS_PORT = 9400
DEFAULT_HEALTH_PORT = 8081
DEFAULT_GUARD_METRICS_PORT = 9401

S = TypeVar("S")


class PortUnavailable(RuntimeError):
    """A port given explicitly is held by another process: the process must not start."""


def parse_port(text: str, setting: str) -> int:
    """`"auto"` -> AUTO_PORT, `"0"` -> 0 (off), `"9400"` -> 9400; ValueError naming `setting`
    for anything else."""
    value = text.strip().lower()
    if value == "auto":
        return AUTO_PORT
    if value.isdigit() and int(value) <= 65535:
        return int(value)
    raise ValueError(f"{setting}={text!r} is not a port (a number up to 65535, auto, or 0 = off)")


def valid_port_setting(port: int | None) -> bool:
    return port is None or port == AUTO_PORT or 0 <= port <= 65535


def port_in_use(port: int, host: str = "0.0.0.0") -> bool:
    """Whether a server could not bind `port` now (another process listens on it)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP servers do
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _in_use(exc: OSError) -> bool:
    return exc.errno == errno.EADDRINUSE


def in_use_message(what: str, port: int, setting: str) -> str:
    """Why a process refuses to start on a taken port, and the ways out."""
    return (
        f"{what}: port {port} is in use (another tolk process on this host?). "
        f"Set {setting} to a free port, to auto (a free one, logged), or 0 (off)"
    )


def open_server(
    make: Callable[[int], tuple[S, int]],
    port: int | None,
    *,
    default: int,
    what: str,
    setting: str,
) -> tuple[S, int] | None:
    """Start a server with `make(port) -> (server, the port it listens on)` as the setting
    `port` says (module notes); None when it is 0 (off). `what` names the server in messages
    ("health probes"), `setting` the knob ("TOLK_HEALTH_PORT")."""
    if port == 0:
        return None
    if port == AUTO_PORT:
        server, bound = make(0)
        log.info("%s on port %d (%s=auto)", what, bound, setting)
        return server, bound
    if port is None:
        try:
            server, bound = make(default)
        except OSError as exc:
            if not _in_use(exc):
                raise
            server, bound = make(0)
            log.warning(
                "%s: port %d is in use (another tolk process on this host?); serving on port "
                "%d instead. Set %s to a port of your choice, to auto (a free one), or 0 (off)",
                what,
                default,
                bound,
                setting,
            )
            return server, bound
        log.info("%s on port %d", what, bound)
        return server, bound
    try:
        server, bound = make(port)
    except OSError as exc:
        if not _in_use(exc):
            raise
        raise PortUnavailable(in_use_message(what, port, setting)) from None
    log.info("%s on port %d", what, bound)
    return server, bound

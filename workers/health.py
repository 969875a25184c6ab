"""The worker's health probes: `/readyz` and `/livez` on a port of their own.

A tolk worker takes no HTTP traffic; Kubernetes uses these two answers to decide when a new
pod counts as available during a rollout (readiness) and when to restart a wedged one
(liveness). They answer different questions, so they check different things:

* `/readyz`, "this worker can serve": the engine is loaded and started, every served language's
  prompt prefix is warm in the prefix cache (so the first request of each language does not pay
  for the prefix), the consumer has subscribed to the request topics (an assignment may not
  come: a group with more workers than partitions leaves some idle, and they are still ready),
  and the worker is not draining or stopped. A worker that is draining turns not-ready at once.
  Its JSON also says which configuration serves and why (`config`: the tuner's
  `ConfigReport`, workers/engine/tuner.py), read by `tolk status`.
* `/livez`, "this process is not wedged": false only when the engine loop has not come round
  (`Engine.loop_heartbeat`, stamped once per loop iteration) for `stall_after_s` while requests
  are in flight. An idle worker is live; a slow step is live until it exceeds the stall time.
  It deliberately checks nothing external: a broker or redis outage must not restart every pod
  (the worker rides those out, docs/ARCHITECTURE.md).

The worker's engine is the serving pipeline's `ServedEngine` (workers/serving/pipeline.py),
which gives the heartbeat and warm languages of the engine inside explicitly
(`engine_attribute` reads them); an engine that reports no heartbeat or warm-up (a test fake)
is taken as live and warm. The port is `TOLK_HEALTH_PORT` (workers/ports.py: a number is that
port or no start, `auto` a free one, unset 8081 or else a free one with a warning, 0 none). Before
`Worker.run` starts the server (while the CLI loads the model and warms the prefixes) nothing
listens: a probe's connection is refused, which Kubernetes counts as a failure; the
Deployment's startupProbe (deploy/k8s/worker/deployment.yaml) covers that time.

The server is a stdlib `ThreadingHTTPServer` on a daemon thread; each answer is JSON
(`{"ok": ..., "reasons": [...]}`) with 200 or 503.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from workers.ports import DEFAULT_HEALTH_PORT, open_server

__all__ = [
    "HealthServer",
    "ProbeResult",
    "WorkerProbes",
    "describe_local_worker",
    "engine_attribute",
    "start_health_server",
]

log = logging.getLogger(__name__)


def engine_attribute(engine: Any, name: str) -> Any:
    """The engine's `name` (the served engine gives its inner engine's), None where it has none."""
    return getattr(engine, name, None)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    reasons: list[str] = field(default_factory=list)  # why not ok (empty when ok)
    config: dict[str, Any] | None = None  # the served configuration (readiness only)

    def body(self) -> bytes:
        body: dict[str, Any] = {"ok": self.ok, "reasons": self.reasons}
        if self.config is not None:
            body["config"] = self.config
        return json.dumps(body).encode()


class ProbedWorker(Protocol):
    """What the probes read of `workers.worker.Worker` (any thread)."""

    engine: Any
    subscribed_event: threading.Event
    stopped_event: threading.Event

    @property
    def draining(self) -> bool: ...

    @property
    def served_languages(self) -> tuple[str, ...]: ...

    def in_flight(self) -> int: ...


class WorkerProbes:
    """Readiness and liveness of one worker, computed on each call."""

    def __init__(
        self,
        worker: ProbedWorker,
        stall_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker = worker
        self.stall_after_s = stall_after_s
        self.clock = clock

    def readiness(self) -> ProbeResult:
        w = self.worker
        reasons: list[str] = []
        if w.stopped_event.is_set():
            reasons.append("stopped")
        elif not w.subscribed_event.is_set():
            reasons.append("starting: engine or consumer not started yet")
        if w.draining:
            reasons.append("draining")
        cold = self.cold_languages()
        if cold:
            reasons.append("prompt prefix not warm: " + ",".join(cold))
        report = engine_attribute(w.engine, "config_report")  # the tuner's (engine/tuner.py)
        config = report.as_json() if report is not None else None
        return ProbeResult(not reasons, reasons, config)

    def cold_languages(self) -> list[str]:
        """Served languages the engine supports whose prefix it has not warmed."""
        warmed = engine_attribute(self.worker.engine, "warmed_languages")
        if warmed is None:
            return []  # the engine does not report warm-up (a fake)
        supported = set(engine_attribute(self.worker.engine, "languages") or ())
        done = set(warmed)
        return [g for g in self.worker.served_languages if g in supported and g not in done]

    def liveness(self) -> ProbeResult:
        heartbeat = engine_attribute(self.worker.engine, "loop_heartbeat")
        in_flight = self.worker.in_flight()
        if heartbeat is None or in_flight == 0:
            return ProbeResult(True)
        silent = self.clock() - heartbeat
        if silent > self.stall_after_s:
            why = (
                f"engine loop made no progress for {silent:.1f} s "
                f"(limit {self.stall_after_s:g} s) with {in_flight} requests in flight"
            )
            return ProbeResult(False, [why])
        return ProbeResult(True)


class _Handler(BaseHTTPRequestHandler):
    probes: WorkerProbes  # set on the subclass made per server

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        path = self.path.split("?", 1)[0]
        if path == "/readyz":
            result = self.probes.readiness()
        elif path == "/livez":
            result = self.probes.liveness()
        else:
            self.send_error(404, "only /readyz and /livez")
            return
        body = result.body()
        self.send_response(200 if result.ok else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        log.debug("probe %s", format % args)  # kubelet probes every few seconds: not INFO


class HealthServer:
    """The probe endpoint on a daemon thread; `shutdown()` stops it."""

    def __init__(self, probes: WorkerProbes, port: int, host: str = "0.0.0.0") -> None:
        handler = type("ProbeHandler", (_Handler,), {"probes": probes})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="tolk-health", daemon=True
        )
        self._thread.start()

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def start_health_server(port: int | None, probes: WorkerProbes) -> HealthServer | None:
    """Serve the probes as the `TOLK_HEALTH_PORT` setting `port` says (workers/ports.py: a
    number, or refuse with `PortUnavailable`; AUTO_PORT; None = 8081 else a free one, with a
    warning); None when it is 0 (off). Never silently without probes."""

    def make(p: int) -> tuple[HealthServer, int]:
        server = HealthServer(probes, p)
        return server, server.port

    opened = open_server(
        make,
        port,
        default=DEFAULT_HEALTH_PORT,
        what="health probes (/readyz, /livez)",
        setting="TOLK_HEALTH_PORT",
    )
    return None if opened is None else opened[0]


def describe_local_worker(port: int | None = None, timeout_s: float = 1.0) -> str:
    """`tolk status`'s line about a worker on this host: its readiness and the configuration
    it serves, from its `/readyz` (`port`: TOLK_HEALTH_PORT when a number, else 8081)."""
    import os
    from urllib.error import HTTPError, URLError
    from urllib.request import urlopen

    if port is None:
        env = os.environ.get("TOLK_HEALTH_PORT", "")
        port = int(env) if env.isdigit() and int(env) > 0 else DEFAULT_HEALTH_PORT
    url = f"http://127.0.0.1:{port}/readyz"
    try:
        with urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (a loopback URL)
            body = json.loads(reply.read())
    except HTTPError as exc:  # 503: not ready, with the same JSON
        body = json.loads(exc.read() or b"{}")
    except (URLError, OSError, ValueError):
        return f"worker: none answers on 127.0.0.1:{port} (TOLK_HEALTH_PORT)"
    state = "ready" if body.get("ok") else "not ready: " + "; ".join(body.get("reasons", []))
    config = body.get("config")
    if not config:
        return f"worker on :{port}: {state}"
    lines = [
        f"worker on :{port}: {state}",
        f"  config: {config['in_use']}",
        f"  why: {config['reason']}",
    ]
    if config.get("probing"):
        lines.append("  probing in the background")
    if config.get("served_vs_probe") is not None:
        normal = config.get("served_normal", 1.0)
        lines.append(
            f"  served decode speed: {config['served_vs_probe']:.2f}x the probe's figure"
            + ("" if normal == 1.0 else f" (normal on this workload: {normal:.2f}x)")
        )
    if config.get("switches"):
        lines.append(f"  switches: {config['switches']} (last: {config['last_switch']})")
    lines += [f"  candidate {c}" for c in config.get("candidates", [])]
    return "\n".join(lines)

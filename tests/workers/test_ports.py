"""Probe and metrics ports on a shared host (workers/ports.py): never silently without them.

Two workers on one host (the CPU scale-out, one per core) want the same ports. The second
used to log `health port 8081 unavailable` and run without probes (and without metrics). Now:
an explicit port that is taken refuses the start, naming the setting (`tolk worker` and `tolk
guard` exit 2, the worker before loading its model); `auto` picks a free port and logs it; an
unset port takes the default or, when that is taken, a free one with a warning; 0 is off.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from bench.scale_out import logged_ports
from tests.workers.fakes import FakeBroker, FakeEngine
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic
from workers.cli import app
from workers.health import WorkerProbes, start_health_server
from workers.ports import AUTO_PORT, PortUnavailable, open_server, parse_port, port_in_use
from workers.process_hooks import start_metrics_server
from workers.settings import Settings
from workers.store.results import InMemoryResultStore
from workers.worker import Worker


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process (here: a plain listening socket) holds for the test."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield int(s.getsockname()[1])


class _Idle:
    engine: Any = None
    subscribed_event = threading.Event()
    stopped_event = threading.Event()
    draining = False
    served_languages: tuple[str, ...] = ()

    def in_flight(self) -> int:
        return 0


def _probes() -> WorkerProbes:
    return WorkerProbes(_Idle(), stall_after_s=1.0)  # type: ignore[arg-type]


def _status(port: int, path: str) -> int:
    try:
        return int(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status)
    except urllib.error.HTTPError as err:
        return int(err.code)


# -- the settings ------------------------------------------------------------------------------


def test_port_settings_parse_numbers_auto_and_off() -> None:
    assert parse_port("9400", "X") == 9400 and parse_port(" AUTO ", "X") == AUTO_PORT
    assert parse_port("0", "X") == 0
    for bad in ("-1", "70000", "high", ""):
        with pytest.raises(ValueError, match="TOLK_HEALTH_PORT="):
            parse_port(bad, "TOLK_HEALTH_PORT")
    s = Settings.from_env({"TOLK_HEALTH_PORT": "auto", "TOLK_METRICS_PORT": "9500"})
    assert (s.health_port, s.metrics_port) == (AUTO_PORT, 9500)
    assert (Settings.from_env({}).health_port, Settings.from_env({}).metrics_port) == (None, None)
    with pytest.raises(ValueError, match="TOLK_METRICS_PORT='nine'"):
        Settings.from_env({"TOLK_METRICS_PORT": "nine"})
    with pytest.raises(ValueError, match="health_port"):
        Settings(health_port=-2)


# -- the servers -------------------------------------------------------------------------------


def test_an_explicit_health_port_that_is_taken_refuses_naming_the_setting(held_port: int) -> None:
    with pytest.raises(PortUnavailable) as info:
        start_health_server(held_port, _probes())
    message = str(info.value)
    assert f"port {held_port} is in use" in message and "TOLK_HEALTH_PORT" in message
    assert "auto" in message


def test_an_explicit_metrics_port_that_is_taken_refuses_naming_the_setting(held_port: int) -> None:
    with pytest.raises(PortUnavailable, match=r"TOLK_METRICS_PORT / --metrics-port"):
        start_metrics_server(held_port, CollectorRegistry())


def test_auto_serves_on_a_free_port_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="workers.ports")
    health = start_health_server(AUTO_PORT, _probes())
    metrics = start_metrics_server(AUTO_PORT, CollectorRegistry())
    assert health is not None and metrics is not None
    try:
        assert _status(health.port, "/livez") == 200
        metrics_port = int(metrics.server_address[1])
        assert _status(metrics_port, "/metrics") == 200
        logged = caplog.text
        assert f"on port {health.port} (TOLK_HEALTH_PORT=auto)" in logged
        assert f"on port {metrics_port} (TOLK_METRICS_PORT / --metrics-port=auto)" in logged
        # bench/scale_out.py finds each worker's ports in its log by these lines
        assert logged_ports(logged) == {"health": health.port, "metrics": metrics_port}
    finally:
        health.shutdown()
        metrics.shutdown()


def test_an_unset_port_falls_back_to_a_free_one_with_a_warning(
    held_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    def make(port: int) -> tuple[socket.socket, int]:
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            s.close()
            raise
        return s, int(s.getsockname()[1])

    opened = open_server(make, None, default=held_port, what="probes", setting="TOLK_HEALTH_PORT")
    assert opened is not None
    server, bound = opened
    server.close()
    assert bound != held_port
    (record,) = [r for r in caplog.records if r.name == "workers.ports"]
    assert record.levelno == logging.WARNING
    assert f"port {held_port} is in use" in record.getMessage()
    assert f"serving on port {bound} instead" in record.getMessage()
    assert "TOLK_HEALTH_PORT" in record.getMessage()
    assert open_server(make, 0, default=held_port, what="probes", setting="X") is None


def test_port_in_use_sees_a_listener(held_port: int) -> None:
    assert port_in_use(held_port)
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        free = int(s.getsockname()[1])
    assert not port_in_use(free)


# -- two workers in one process: both have their probes ----------------------------------------


def _worker(broker: FakeBroker, engine: FakeEngine, **kw: Any) -> Worker:
    settings = Settings(languages=("de",), drain_refresh_s=0, poll_timeout_s=0.01, **kw)
    return Worker(settings, engine, broker.consumer_factory(), broker.producer_factory(),
                  store=InMemoryResultStore(), registry=CollectorRegistry())  # fmt: skip


def _broker() -> FakeBroker:
    broker = FakeBroker()
    broker.create_topic(request_topic("de"), 1)
    broker.create_topic(REPLIES, 1)
    broker.create_topic(DEAD_LETTERS, 1)
    return broker


def test_two_workers_with_unset_ports_both_serve_probes_and_metrics() -> None:
    broker = _broker()
    workers, threads = [], []
    try:
        for k in range(2):
            worker = _worker(broker, FakeEngine(languages=("de",)), worker_id=f"w{k}")
            assert worker.settings.health_port is None and worker.settings.metrics_port is None
            workers.append(worker)
            threads.append(worker.run_in_thread())
            assert worker.subscribed_event.wait(10)
        ports = [(w.health_port, w.metrics_port) for w in workers]
        assert all(h and m for h, m in ports), ports
        assert len({p for pair in ports for p in pair}) == 4  # four different ports
        for health, metrics in ports:
            assert _status(health, "/livez") == 200
            assert _status(metrics, "/metrics") == 200
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(10)


def test_a_worker_on_a_taken_explicit_port_does_not_start(held_port: int) -> None:
    engine = FakeEngine(languages=("de",))
    worker = _worker(_broker(), engine, worker_id="w", health_port=held_port, metrics_port=0)
    with pytest.raises(PortUnavailable, match="TOLK_HEALTH_PORT"):
        worker.run(threading.Event())
    assert not engine.started


# -- the commands ------------------------------------------------------------------------------


ENV = {"TOLK_BOOTSTRAP": "127.0.0.1:1", "TOLK_TOPIC_PREFIX": "t-ports."}


def test_tolk_worker_exits_2_before_the_model_on_a_taken_port(
    held_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import workers.cli as cli

    def no_broker(settings: Any) -> None:
        raise typer.Exit(7)  # reached only if the port check let it through

    monkeypatch.setattr(cli, "_check_broker_or_exit", no_broker)
    runner = CliRunner()
    out = runner.invoke(app, ["worker"], env={**ENV, "TOLK_HEALTH_PORT": str(held_port)})
    assert out.exit_code == 2, out.output
    assert f"port {held_port} is in use" in out.output and "TOLK_HEALTH_PORT" in out.output
    out = runner.invoke(
        app, ["worker", "--metrics-port", str(held_port)], env={**ENV, "TOLK_HEALTH_PORT": "0"}
    )
    assert out.exit_code == 2, out.output
    assert "--metrics-port" in out.output
    out = runner.invoke(app, ["worker", "--metrics-port", "auto"], env=ENV)
    assert out.exit_code == 7, out.output  # auto: nothing to refuse, on to the broker check
    out = runner.invoke(app, ["worker", "--metrics-port", "high"], env=ENV)
    assert out.exit_code == 2 and "--metrics-port='high' is not a port" in out.output


def test_tolk_guard_exits_2_on_a_taken_metrics_port(held_port: int) -> None:
    out = CliRunner().invoke(app, ["guard", "--metrics-port", str(held_port)], env=ENV)
    assert out.exit_code == 2, (out.output, out.exception)
    assert f"port {held_port} is in use" in out.output
    assert "tolk guard --metrics-port" in out.output

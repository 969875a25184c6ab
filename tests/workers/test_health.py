"""The worker's probes (workers/health.py): unit checks, then over HTTP on real workers.

* The wrapper walk finds the engine's heartbeat and warm-up through `FairEngine.engine` and the
  `.inner` of the other wrappers.
* On a real worker (real broker and redis) with `StallableEngine`, a fake engine with a loop
  thread that stamps `loop_heartbeat` like `Engine._loop` and blocks on a request carrying
  `STALL_MARKER` until released: readiness is false while a language's prefix is not warm and
  true once it is; liveness turns false when the loop is stuck with a request in flight and true
  again when it moves; a draining worker is not ready.
* With the real SmolLM2 engine: the same engine is not ready before `Engine.warm()` and ready
  after it (marked slow: it loads the model).
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from schemas.codec import encode_request
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.workers.fakes import FAKE_LANGUAGES, create_prefixed_topics
from tests.workers.polling import wait_for
from topics.catalog import REPLIES, request_topic
from workers.engine.types import FinishReason, GenerationResult, RequestHandle, TranslationRequest
from workers.health import WorkerProbes, engine_attribute, start_health_server
from workers.serving.pipeline import ServingOptions, build_served_engine
from workers.settings import Settings
from workers.worker import Worker

STALL_MARKER = "__stall__"


class StallableEngine:
    """A `TranslationEngine` with a step loop that can be made to hang (see the module notes)."""

    model_version = "stall-1"
    languages = FAKE_LANGUAGES

    def __init__(self, warmed: set[str] | None = None) -> None:
        self.loop_heartbeat: float | None = None
        self.warmed_languages: set[str] = set() if warmed is None else warmed
        self.unstick = threading.Event()
        self._jobs: queue.SimpleQueue[tuple[str, str, RequestHandle]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        handle = RequestHandle(request.request_id, lambda _rid: None)
        self._jobs.put((request.request_id, request.text, handle))
        return handle

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="stallable", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self._stop.set()
        self.unstick.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.loop_heartbeat = time.monotonic()
            try:
                rid, text, handle = self._jobs.get(timeout=0.02)
            except queue.Empty:
                continue
            if STALL_MARKER in text:
                self.unstick.wait()  # a step that does not return
            handle.set_result(
                GenerationResult(rid, [1], text.upper(), FinishReason.STOP, tokens_out=1)
            )


# -- unit ------------------------------------------------------------------------------------


def _served(engine: Any) -> Any:
    """`engine` in the serving pipeline, its stages around it, as the worker gets it."""
    options = ServingOptions.of(Settings(), protect_spans=True, faithful=False)
    return build_served_engine(engine, options)


def test_the_served_engine_gives_the_engines_heartbeat_and_warm_languages() -> None:
    engine = StallableEngine(warmed={"de"})
    engine.loop_heartbeat = 12.5
    served = _served(engine)
    assert engine_attribute(served, "loop_heartbeat") == 12.5
    assert engine_attribute(served, "warmed_languages") == {"de"}
    assert engine_attribute(_served(StallableEngine()), "loop_heartbeat") is None  # not yet


class _StubWorker:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.subscribed_event = threading.Event()
        self.stopped_event = threading.Event()
        self.draining = False
        self.served_languages = ("de", "fr", "xx")  # xx: no prompt, never required warm
        self.inflight = 0

    def in_flight(self) -> int:
        return self.inflight


def test_readiness_needs_subscription_warm_prefixes_and_no_drain() -> None:
    engine = StallableEngine(warmed={"de"})
    worker = _StubWorker(_served(engine))
    probes = WorkerProbes(worker, stall_after_s=5.0)
    assert probes.readiness().reasons == [
        "starting: engine or consumer not started yet",
        "prompt prefix not warm: fr",
    ]
    worker.subscribed_event.set()
    engine.warmed_languages.add("fr")
    assert probes.readiness().ok
    worker.draining = True
    assert probes.readiness().reasons == ["draining"]
    worker.stopped_event.set()
    assert probes.readiness().reasons == ["stopped", "draining"]


def test_liveness_fails_only_when_the_loop_is_silent_with_work() -> None:
    engine = StallableEngine()
    worker = _StubWorker(engine)
    now = [100.0]
    probes = WorkerProbes(worker, stall_after_s=5.0, clock=lambda: now[0])
    assert probes.liveness().ok  # no heartbeat yet: cannot tell, so not restarted
    engine.loop_heartbeat = 90.0
    assert probes.liveness().ok  # silent 10 s, but idle
    worker.inflight = 3
    result = probes.liveness()
    assert not result.ok and "10.0 s" in result.reasons[0] and "3 requests" in result.reasons[0]
    engine.loop_heartbeat = 97.0
    assert probes.liveness().ok  # silent 3 s: a slow step, within the limit


def test_probe_and_drain_settings_from_the_environment() -> None:
    s = Settings.from_env(
        {"TOLK_HEALTH_PORT": "0", "TOLK_LIVENESS_STALL_S": "30", "TOLK_DRAIN_REFRESH_S": "2.5"}
    )
    assert (s.health_port, s.liveness_stall_s, s.drain_refresh_s) == (0, 30.0, 2.5)
    d = Settings()
    # unset: 8081, or a free port with a warning when 8081 is taken (tests/workers/test_ports.py)
    assert (d.health_port, d.liveness_stall_s, d.drain_refresh_s) == (None, 120.0, 5.0)
    with pytest.raises(ValueError, match="TOLK_LIVENESS_STALL_S"):
        Settings.from_env({"TOLK_LIVENESS_STALL_S": "soon"})
    with pytest.raises(ValueError, match="liveness_stall_s"):
        Settings(liveness_stall_s=0)
    with pytest.raises(ValueError, match="health_port"):
        Settings(health_port=70000)
    with pytest.raises(ValueError, match="drain_refresh_s"):
        Settings(drain_refresh_s=-1)


def test_health_port_zero_starts_no_server() -> None:
    probes = WorkerProbes(_StubWorker(StallableEngine()), stall_after_s=1.0)
    assert start_health_server(0, probes) is None
    server = start_health_server(free_port(), probes)
    assert server is not None
    try:
        assert probe(server.port, "/readyz")[0] == 503  # the stub never subscribed
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
        assert err.value.code == 404
    finally:
        server.shutdown()


# -- real workers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Stack:
    """One test's private topics and group on the shared broker."""

    def __init__(self, bootstrap: str, redis: str, langs: tuple[str, ...]) -> None:
        self.bootstrap, self.redis, self.langs = bootstrap, redis, langs
        self.prefix = f"t{uuid.uuid4().hex[:10]}."
        create_prefixed_topics(bootstrap, self.prefix, langs, partitions=1)
        self.running: list[tuple[Worker, threading.Thread]] = []

    def worker(self, engine: Any, **kw: Any) -> tuple[Worker, int]:
        port = free_port()
        settings = Settings(
            bootstrap=self.bootstrap,
            redis_url=self.redis,
            group_id=f"tolk-test-{uuid.uuid4().hex[:10]}",
            languages=self.langs,
            topic_prefix=self.prefix,
            metrics_port=0,
            health_port=port,
            drain_refresh_s=0,
            worker_id=f"w-{uuid.uuid4().hex[:6]}",
            session_timeout_ms=10_000,
            **kw,
        )
        worker = Worker(settings, engine, registry=CollectorRegistry())
        self.running.append((worker, worker.run_in_thread()))
        wait_for(worker.subscribed_event.is_set, 30, "worker subscribed")
        return worker, port

    def send(self, lang: str, text: str) -> None:
        producer = Producer({"bootstrap.servers": self.bootstrap})
        record = {
            "request_id": uuid.uuid4().hex,
            "conversation_id": None,
            "source_lang": "en",
            "target_lang": lang,
            "text": text,
            "created_at": int(time.time() * 1000),
            "deadline": None,
            "reply_topic": self.prefix + REPLIES,
            "metadata": {},
        }
        producer.produce(self.prefix + request_topic(lang), encode_request(record))
        assert producer.flush(10) == 0

    def close(self) -> None:
        for worker, thread in self.running:
            worker.stop()
            thread.join(20)


@pytest.fixture
def stack(kafka_bootstrap: str, redis_url: str) -> Iterator[Stack]:  # noqa: F811
    s = Stack(kafka_bootstrap, redis_url, ("de", "fr"))
    yield s
    s.close()


@pytest.mark.kafka
@pytest.mark.redis
def test_readiness_false_until_the_prefixes_are_warm_then_true(stack: Stack) -> None:
    engine = StallableEngine(warmed={"de"})
    worker, port = stack.worker(engine)
    status, body = probe(port, "/readyz")
    assert status == 503 and body["reasons"] == ["prompt prefix not warm: fr"]
    engine.warmed_languages.add("fr")
    assert probe(port, "/readyz") == (200, {"ok": True, "reasons": []})
    assert probe(port, "/livez")[0] == 200


@pytest.mark.kafka
@pytest.mark.redis
def test_liveness_false_while_the_engine_loop_is_stuck_and_ready_false_while_draining(
    stack: Stack,
) -> None:
    engine = StallableEngine(warmed={"de", "fr"})
    worker, port = stack.worker(engine, liveness_stall_s=0.5, drain_timeout_s=10.0)
    wait_for(worker.assigned_event.is_set, 30, "assignment")
    stack.send("de", f"hello {STALL_MARKER}")
    wait_for(lambda: worker.in_flight() == 1, 30, "the request in the engine")
    wait_for(lambda: probe(port, "/livez")[0] == 503, 10, "/livez failing")
    status, body = probe(port, "/livez")
    assert status == 503 and "1 requests in flight" in body["reasons"][0]
    assert probe(port, "/readyz")[0] == 200  # stuck is a liveness matter, not readiness

    worker.stop()  # drains: waits for the stuck request, readiness turns false at once
    wait_for(lambda: worker.draining, 10, "draining")
    assert probe(port, "/readyz")[1]["reasons"] == ["draining"]
    engine.unstick.set()  # the step returns: the loop comes round again
    wait_for(lambda: worker.in_flight() == 0, 10, "the request answered")
    wait_for(worker.stopped_event.is_set, 20, "worker stopped")


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.redis
def test_real_engine_not_ready_before_warm_up_and_ready_after(smollm2: Any, stack: Stack) -> None:
    from workers.engine.engine import Engine, EngineConfig

    engine = Engine(smollm2, EngineConfig(kv_cache_tokens=2048, max_new_tokens=8))
    worker, port = stack.worker(engine)
    status, body = probe(port, "/readyz")
    assert status == 503 and body["reasons"] == ["prompt prefix not warm: de,fr"]
    assert probe(port, "/livez")[0] == 200  # its loop runs: alive, just not ready
    worker.stop()
    wait_for(worker.stopped_event.is_set, 30, "first worker stopped")

    engine.warm(["de", "fr"])  # what EngineConfig.warm_languages does at start-up
    _, port = stack.worker(engine)
    assert probe(port, "/readyz") == (200, {"ok": True, "reasons": []})
    assert engine.loop_heartbeat is not None
    assert time.monotonic() - engine.loop_heartbeat < 5.0


def test_readiness_shows_the_served_configuration_and_tolk_status_reads_it() -> None:
    """The tuner's report (workers/engine/tuner.py) travels in /readyz's JSON, and `tolk
    status`'s worker line (`describe_local_worker`) reads it back from the port."""
    from workers.engine.autoconfig import ConfigReport
    from workers.health import describe_local_worker

    engine = StallableEngine(warmed={"de", "fr"})
    engine.config_report = ConfigReport(  # type: ignore[attr-defined]
        in_use="int8+compiled",
        reason="fastest that passes the quality gate",
        candidates=("float32: b1 40.0 tok/s", "int8+compiled: b1 90.0 tok/s"),
        switches=1,
        last_switch="int8 -> int8+compiled: first start",
        served_vs_probe=0.93,
        served_normal=0.82,
    )
    worker = _StubWorker(_served(engine))
    worker.subscribed_event.set()
    probes = WorkerProbes(worker, stall_after_s=5.0)
    body = json.loads(probes.readiness().body())
    assert body["ok"] and body["config"]["in_use"] == "int8+compiled"
    server = start_health_server(free_port(), probes)
    assert server is not None
    try:
        text = describe_local_worker(server.port)
    finally:
        server.shutdown()
    assert f"worker on :{server.port}: ready" in text
    assert "config: int8+compiled\n  why: fastest that passes the quality gate" in text
    assert "0.93x the probe's figure (normal on this workload: 0.82x)" in text
    assert "switches: 1" in text
    assert "candidate float32: b1 40.0 tok/s" in text
    assert "none answers" in describe_local_worker(free_port())
